"""Training recipes: YAML files in `configs/` validated into typed dataclasses (unknown keys are errors), and the
EAGLE-3 head's training settings (`Eagle3Spec`).

Each field carries its help text and range (`parse_jax.settings.setting`): `__post_init__` checks against it, a
recipe file's values are checked with it (errors name the key's path in the recipe), and the `train` /
`train-eagle3` flags take their defaults, ranges and help from it. Nothing here imports jax at import time (the CLI
builds its parser from these classes without it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from parse_jax.errors import ConfigError
from parse_jax.settings import check_setting, check_settings, setting, setting_type
from parse_jax.utils.paths import config_dir
from parse_jax.utils.validation import SEED_MAX

if TYPE_CHECKING:
    from parse_jax.models.config import ModelConfig

CONFIG_DIR = config_dir()  # configs/ of the checkout; parse_jax/configs/ in a wheel


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A llama-family decoder; vocab comes from the tokenizer."""

    hidden_size: int = setting(64, "model width (num_heads even head dims)", lo=1)
    num_layers: int = setting(1, "decoder layers", lo=1)
    num_heads: int = setting(2, "attention heads", lo=1)
    num_kv_heads: int = setting(2, "key/value heads (num_heads a multiple of them)", lo=1)
    intermediate_size: int = setting(128, "FFN width", lo=1)
    tie_word_embeddings: bool = setting(True, "the output projection is the embedding")
    max_position_embeddings: int = setting(128, "longest sequence (more than the recipe's seq_len)", lo=1)

    def __post_init__(self) -> None:
        check_settings(self, prefix="model: ")

    def config(self, vocab_size: int, bos_token_id: int | None = None,
               eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """The decoder config this spec describes, for a tokenizer of `vocab_size` tokens."""
        from parse_jax.models.config import ModelConfig

        return ModelConfig(
            architecture="llama", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    """One optimisation run: AdamW, linear warmup then cosine decay to `lr * final_lr_ratio`, global-norm clip.
    A NaN, infinite or non-positive learning rate would train a model of NaNs: refused."""

    steps: int = setting(1000, "optimisation steps", lo=1)
    batch_size: int = setting(64, "rows per step", lo=1)
    lr: float = setting(3e-3, "peak learning rate", lo=0.0, lo_open=True)
    warmup_steps: int = setting(100, "steps of linear warmup", lo=0)
    final_lr_ratio: float = setting(0.05, "the last step's learning rate, as a fraction of lr", lo=0.0, hi=1.0)
    weight_decay: float = setting(0.01, "AdamW weight decay", lo=0.0)
    grad_clip: float = setting(1.0, "global gradient-norm clip", lo=0.0, lo_open=True)
    checkpoint_every: int = setting(200, "steps between checkpoints", lo=1)
    keep_checkpoints: int = setting(2, "checkpoints kept", lo=1)
    seed: int = setting(0, "seed of the initial weights and the batches", lo=0, hi=SEED_MAX)

    def __post_init__(self) -> None:
        check_settings(self, prefix="training: ")


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """The target's rows: which solutions they hold (clean, corrupted, real draft outputs) and the judge weight."""

    error_fraction: float = setting(0.3, "share of synthetic rows with one corrupted step (rest: clean solutions)",
                                    lo=0.0, hi=1.0)
    weight: float = setting(1.0, "weight of the judge-token loss against the LM loss (0: no judge copies)", lo=0.0)
    real_fraction: float = setting(0.3, "share of target rows that are real draft outputs (rest: synthetic)",
                                   lo=0.0, hi=1.0, hi_open=True)
    draft_samples: int = setting(4000, "train problems the draft solves (sampled) for the real outputs", lo=0)
    draft_temperature: float = setting(1.0, "temperature of those samples", lo=0.0)
    sample_batch: int = setting(256, "problems per sampling call", lo=1)

    def __post_init__(self) -> None:
        check_settings(self, prefix="judge: ")


@dataclasses.dataclass(frozen=True)
class GrowSpec:
    """Widen the trained target to `model` without changing its function (train/grow.py), then train it at full
    width for `phase`: a weight-bound target for a fraction of the cost of training it from scratch."""

    enabled: bool = setting(False, "grow the target (else train it at its shape from scratch)")
    model: ModelSpec = ModelSpec()
    phase: PhaseSpec = PhaseSpec()


@dataclasses.dataclass(frozen=True)
class Eagle3Spec:
    """EAGLE-3 head training settings (parse_jax.train.eagle3); the defaults trained the shipped head."""

    steps: int = setting(600, "optimisation steps", lo=1)
    batch_size: int = setting(32, "rows per step", lo=1)
    lr: float = setting(4e-3, "peak learning rate", lo=0.0, lo_open=True)
    warmup_steps: int = setting(100, "steps of linear warmup", lo=0)
    unroll: int = setting(4, "training-time-test steps (the head unrolled on its own outputs)", lo=1)
    step_decay: float = setting(0.8, "unroll step k's loss weighs step_decay ** k", lo=0.0, hi=1.0, lo_open=True)
    samples: int = setting(4000, "train problems the target solves for the data", lo=1)
    seq_len: int = setting(40, "row length (prompt, solution, EOS, padding)", lo=1)
    seed: int = setting(0, "seed of the problems, the initial weights and the batches", lo=0, hi=SEED_MAX)
    draft_vocab_size: int = setting(0, "with --data: the head drafts over this many of the most frequent response "
                                       "tokens, with its own LM head and d2t/t2d maps (0: the target's whole "
                                       "vocabulary, its LM head shared)", lo=0)
    checkpoint_every: int = setting(200, "steps between checkpoints", lo=1)

    def __post_init__(self) -> None:
        check_settings(self, prefix="EAGLE-3 training: ")

    def phase(self) -> PhaseSpec:
        return PhaseSpec(steps=self.steps, batch_size=self.batch_size, lr=self.lr, warmup_steps=self.warmup_steps,
                         checkpoint_every=self.checkpoint_every, seed=self.seed)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str = setting("custom", "recipe name (the YAML file's)")
    task: str = setting("default", "embedded task preset")
    seq_len: int = setting(40, "static model input length of every training row (rows are padded to it)", lo=8)
    draft_model: ModelSpec = ModelSpec()
    target_model: ModelSpec = ModelSpec(hidden_size=192, num_layers=3, num_heads=4, num_kv_heads=4,
                                        intermediate_size=512)
    draft: PhaseSpec = PhaseSpec()
    target: PhaseSpec = PhaseSpec()
    judge: JudgeSpec = JudgeSpec()
    grow: GrowSpec = GrowSpec()
    out: str = setting("out/pair", "output folder")

    def __post_init__(self) -> None:
        check_settings(self, prefix="recipe: ")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, d: Any, where: str) -> Any:
    """`cls` from mapping `d`: nested mappings built the same way, every other value checked against its field's
    type and range with the key's path in the recipe named (`recipe x.draft.lr must be a number, got [1]`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known: {sorted(fields)}")
    kw = {k: (check_setting(cls, k, v, f"{where}.{k}") if "about" in fields[k].metadata
              else _build(setting_type(cls, k), v, f"{where}.{k}")) for k, v in d.items()}
    return cls(**kw)


def _check(r: Recipe) -> None:
    """What no single field's range says: the task exists, and the model shapes fit together and hold seq_len."""
    from parse_jax.tasks import PRESETS

    if r.task not in PRESETS:
        raise ConfigError(f"recipe {r.name}: unknown task {r.task!r}; known: {', '.join(PRESETS)}")
    models = [("draft_model", r.draft_model), ("target_model", r.target_model)]
    if r.grow.enabled:
        models.append(("grow.model", r.grow.model))
    for name, m in models:
        if m.hidden_size % m.num_heads or (m.hidden_size // m.num_heads) % 2:
            raise ConfigError(f"recipe {r.name}: {name}.hidden_size must split into num_heads even head dims")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"recipe {r.name}: {name}.num_heads must be a multiple of num_kv_heads")
        if m.max_position_embeddings < r.seq_len + 1:
            raise ConfigError(f"recipe {r.name}: {name}.max_position_embeddings must exceed seq_len")
    if r.grow.enabled:  # the same rule the widening applies (vocabulary size does not matter to it)
        from parse_jax.train.grow import check_growable, grown_config  # jax: only when a recipe grows

        narrow = r.target_model.config(vocab_size=1)
        try:
            check_growable(narrow, grown_config(narrow, r.grow.model.config(vocab_size=1)))
        except ConfigError as e:
            raise ConfigError(f"recipe {r.name}: grow.model must widen target_model: {e}") from None


def recipe_from_dict(d: Any, name: str = "custom") -> Recipe:
    if isinstance(d, dict) and "name" not in d:
        d = {**d, "name": name}
    r = _build(Recipe, d, f"recipe {name}")
    _check(r)
    return r


def known_recipes() -> list[str]:
    """The shipped recipes' names: the YAML files of `configs/` that hold a recipe (not the mesh configs beside
    them, whose one key is `mesh`)."""
    def is_recipe(path: Path) -> bool:  # a recipe with a typo is still listed (loading it names the typo)
        try:
            d = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return True
        return not (isinstance(d, dict) and set(d) == {"mesh"})

    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if is_recipe(p)) if CONFIG_DIR.is_dir() else []


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A recipe by name (`configs/NAME.yaml`) or by path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise ConfigError(f"recipe file not found: {p}")
    else:
        p = CONFIG_DIR / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ConfigError(f"unknown recipe {str(name_or_path)!r}; known recipes: "
                              f"{', '.join(known_recipes()) or 'none'} (in {CONFIG_DIR})")
    try:
        d = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {p} is not valid YAML: {e}") from None
    return recipe_from_dict(d if d is not None else {}, name=p.stem)


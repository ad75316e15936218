"""Training recipes: YAML files in `configs/` validated into typed dataclasses (unknown keys are errors)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from parse_jax.errors import ConfigError
from parse_jax.models.config import ModelConfig
from parse_jax.train.grow import check_growable, grown_config
from parse_jax.utils.paths import config_dir
from parse_jax.utils.validation import SEED_MAX, check_float, check_int

CONFIG_DIR = config_dir()  # configs/ of the checkout; parse_jax/configs/ in a wheel


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A llama-family decoder; vocab comes from the tokenizer."""

    hidden_size: int = 64
    num_layers: int = 1
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 128

    def config(self, vocab_size: int, bos_token_id: int | None = None,
               eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        """The decoder config this spec describes, for a tokenizer of `vocab_size` tokens."""
        return ModelConfig(
            architecture="llama", vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)


@dataclasses.dataclass(frozen=True)
class PhaseSpec:
    """One optimisation run: AdamW, linear warmup then cosine decay to `lr * final_lr_ratio`, global-norm clip."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 100
    final_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        """A NaN, infinite or non-positive learning rate would train a head of NaNs: refused here."""
        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints"):
            check_int(f"training: {name}", getattr(self, name), 1)
        check_int("training: warmup_steps", self.warmup_steps, 0)
        check_int("training: seed", self.seed, 0, SEED_MAX)
        check_float("training: lr", self.lr, 0.0, min_open=True)
        check_float("training: final_lr_ratio", self.final_lr_ratio, 0.0, 1.0)
        check_float("training: weight_decay", self.weight_decay, 0.0)
        check_float("training: grad_clip", self.grad_clip, 0.0, min_open=True)


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """The target's rows: which solutions they hold (clean, corrupted, real draft outputs) and the judge weight."""

    error_fraction: float = 0.3    # share of synthetic rows with one corrupted step (rest: clean solutions)
    weight: float = 1.0            # weight of the judge-token loss against the LM loss (0: no judge copies)
    real_fraction: float = 0.3     # share of target rows that are real draft outputs (rest: synthetic)
    draft_samples: int = 4000      # train problems the draft solves (sampled) for the real outputs
    draft_temperature: float = 1.0
    sample_batch: int = 256


@dataclasses.dataclass(frozen=True)
class GrowSpec:
    """Widen the trained target to `model` without changing its function (train/grow.py), then train it at full
    width for `phase`: a weight-bound target for a fraction of the cost of training it from scratch."""

    enabled: bool = False
    model: ModelSpec = ModelSpec()
    phase: PhaseSpec = PhaseSpec()


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str = "custom"
    task: str = "default"
    seq_len: int = 40              # static model input length of every training row (rows are padded to it)
    draft_model: ModelSpec = ModelSpec()
    target_model: ModelSpec = ModelSpec(hidden_size=192, num_layers=3, num_heads=4, num_kv_heads=4,
                                        intermediate_size=512)
    draft: PhaseSpec = PhaseSpec()
    target: PhaseSpec = PhaseSpec()
    judge: JudgeSpec = JudgeSpec()
    grow: GrowSpec = GrowSpec()
    out: str = "out/pair"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _convert(value: Any, tp: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _build(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known: {sorted(fields)}")
    kw = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in d.items()}
    return cls(**kw)


def _check(r: Recipe) -> None:
    from parse_jax.tasks import PRESETS

    if r.task not in PRESETS:
        raise ConfigError(f"recipe {r.name}: unknown task {r.task!r}; known: {', '.join(PRESETS)}")
    if r.seq_len < 8:
        raise ConfigError(f"recipe {r.name}: seq_len must be >= 8, got {r.seq_len}")
    models = [("draft_model", r.draft_model), ("target_model", r.target_model)]
    phases = [("draft", r.draft), ("target", r.target)]
    if r.grow.enabled:
        models.append(("grow.model", r.grow.model))
        phases.append(("grow.phase", r.grow.phase))
    for name, m in models:
        for f in dataclasses.fields(m):
            v = getattr(m, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
                raise ConfigError(f"recipe {r.name}: {name}.{f.name} must be positive, got {v}")
        if m.hidden_size % m.num_heads or (m.hidden_size // m.num_heads) % 2:
            raise ConfigError(f"recipe {r.name}: {name}.hidden_size must split into num_heads even head dims")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"recipe {r.name}: {name}.num_heads must be a multiple of num_kv_heads")
        if m.max_position_embeddings < r.seq_len + 1:
            raise ConfigError(f"recipe {r.name}: {name}.max_position_embeddings must exceed seq_len")
    if r.grow.enabled:  # the same rule the widening applies (vocabulary size does not matter to it)
        narrow = r.target_model.config(vocab_size=1)
        try:
            check_growable(narrow, grown_config(narrow, r.grow.model.config(vocab_size=1)))
        except ConfigError as e:
            raise ConfigError(f"recipe {r.name}: grow.model must widen target_model: {e}") from None
    for name, p in phases:
        if p.steps < 1 or p.batch_size < 1 or p.checkpoint_every < 1 or p.keep_checkpoints < 1:
            raise ConfigError(f"recipe {r.name}: {name}.steps/batch_size/checkpoint_every/keep_checkpoints "
                              "must be >= 1")
        if not p.lr > 0 or p.warmup_steps < 0 or not 0 <= p.final_lr_ratio <= 1 or p.grad_clip <= 0:
            raise ConfigError(f"recipe {r.name}: {name} needs lr > 0, warmup_steps >= 0, "
                              "0 <= final_lr_ratio <= 1, grad_clip > 0")
    j = r.judge
    if not 0 <= j.error_fraction <= 1 or not 0 <= j.real_fraction < 1 or j.weight < 0:
        raise ConfigError(f"recipe {r.name}: judge.error_fraction must be in [0, 1], judge.real_fraction in "
                          "[0, 1), judge.weight >= 0")
    if j.draft_samples < 0 or j.sample_batch < 1 or j.draft_temperature < 0:
        raise ConfigError(f"recipe {r.name}: judge.draft_samples >= 0, sample_batch >= 1, draft_temperature >= 0")


def recipe_from_dict(d: Any, name: str = "custom") -> Recipe:
    if isinstance(d, dict) and "name" not in d:
        d = {**d, "name": name}
    r = _build(Recipe, d, f"recipe {name}")
    _check(r)
    return r


def known_recipes() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


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


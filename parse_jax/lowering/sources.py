"""Models as shapes only, for lowering and memory planning: a config and a tokenizer, params as
`jax.ShapeDtypeStruct`s (an 8B model costs nothing), read from a model folder, a `config.json` file or a shipped
config by name (`configs/models/NAME.json`: qwen3-8b, qwen3-0.6b, llama3-8b, llama3-1b). No weights are read.

A folder without tokenizer files (or a bare config) gets the embedded task's tokenizer: the PARSE suffix and judge
words are then the task's, which changes a few token counts, not the shapes a run allocates.
"""

from __future__ import annotations

from pathlib import Path

import jax

from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import ModelConfig, read_hf_config
from parse_jax.models.model import Model, param_shapes
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.speculation.eagle3 import Eagle3, Eagle3Config, init_head
from parse_jax.utils.paths import config_dir

MODELS_DIR = "models"


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in (config_dir() / MODELS_DIR).glob("*.json"))


def _config(source: str | Path, dtype: str | None) -> tuple[ModelConfig, Path | None]:
    """(config, folder holding it or None) of a shipped name, a config.json file or a model folder."""
    from parse_jax.checkpoints.orbax import CONFIG_FILE, read_config

    path = Path(source)
    shipped = config_dir() / MODELS_DIR / f"{source}.json"
    if not path.exists() and shipped.is_file():
        return read_hf_config(shipped, dtype), None
    if path.is_file():
        return read_hf_config(path, dtype), None
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            cfg = read_config(path)
            return (cfg if dtype is None else cfg.replace(dtype=dtype)), path
        if (path / "config.json").is_file():
            return read_hf_config(path / "config.json", dtype), path
        raise CheckpointError(f"{path} holds no model config (config.json or {CONFIG_FILE}); a training run "
                              "folder is lowered through the model folder its config came from")
    raise ConfigError(f"model {str(source)!r} is neither a folder, a config.json file nor a shipped config; "
                      f"shipped: {', '.join(shipped_configs())}")


def _tokenizer(folder: Path | None, cfg: ModelConfig) -> Tokenizer:
    from parse_jax.tasks import TOKENIZER_DIR

    if folder is not None and (folder / "tokenizer.json").is_file():
        tok = Tokenizer.from_folder(folder)
    else:
        tok = Tokenizer.from_folder(TOKENIZER_DIR)
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens, more than the model's vocab_size "
                          f"{cfg.vocab_size}")
    return tok


def shape_model(source: str | Path, dtype: str | None = None) -> Model:
    """A `Model` of `source`'s config and tokenizer whose params are shapes (see the module doc)."""
    cfg, folder = _config(source, dtype)
    return Model(cfg, param_shapes(cfg), _tokenizer(folder, cfg))


PADDING_SHARE = 0.01  # embedding padding (rows to a multiple of 64 or 128): Qwen2.5-7B 152064 vs 0.5B 151936, 0.08%


def check_shape_pair(target: Model, draft: Model) -> None:
    """A target and draft of different vocabulary sizes are padded to one (`align_vocab`) where they share a
    tokenizer. A model lowered from its config alone carries the embedded tokenizer as a stand-in, which shows
    nothing: there, sizes that differ by more than embedding padding (`PADDING_SHARE`) are two vocabularies,
    refused naming both sizes."""
    from parse_jax.tasks import TOKENIZER_DIR

    stand_in = [name for name, m in (("target", target), ("draft", draft))
                if Path(m.tokenizer.source).resolve() == Path(TOKENIZER_DIR).resolve()]
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if stand_in and abs(tv - dv) > PADDING_SHARE * max(tv, dv):
        raise ConfigError(f"target and draft have different vocabularies (target {tv} rows, draft {dv} rows: more "
                          f"apart than embedding padding) and the {' and '.join(stand_in)} "
                          f"{'has' if len(stand_in) == 1 else 'have'} no tokenizer.json to show one tokenizer: "
                          "token-level speculation and PARSE need one; lower a pair of one vocabulary, or give "
                          "model folders with their tokenizers")


def shape_pair(folder: str | Path | None = None, dtype: str | None = None) -> tuple[Model, Model]:
    """(target, draft) of a pair folder (target/ + draft/; default the embedded pair) as shapes."""
    from parse_jax.checkpoints.pair import PAIR_DIR

    folder = PAIR_DIR if folder is None else Path(folder)
    missing = [n for n in ("target", "draft") if not (folder / n).is_dir()]
    if missing:
        raise CheckpointError(f"{folder} is not a pair folder: no {' or '.join(m + '/' for m in missing)}")
    return shape_model(folder / "target", dtype), shape_model(folder / "draft", dtype)


def shape_head(target: ModelConfig) -> Eagle3:
    """An EAGLE-3 head for `target` (its default taps) as shapes: what modes eagle3 and parse+eagle3 lower with."""
    cfg = Eagle3Config.for_target(target)
    return Eagle3(cfg, jax.eval_shape(lambda: init_head(cfg)))


def read_head_shapes(path: str | Path, target: Model) -> Eagle3:
    """A head folder (any layout `load_eagle3` reads), checked against `target`, as shapes: its draft vocabulary,
    maps and taps are what the programs are lowered with. Unlike the models, its weights are read, once, for that
    check."""
    from parse_jax.speculation.eagle3.formats import load_eagle3  # checkpoint readers (Orbax): only when asked

    head = load_eagle3(path, target)
    return Eagle3(head.config, jax.eval_shape(lambda: head.params))

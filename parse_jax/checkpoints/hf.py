"""Hugging Face folders <-> `Model`: config.json + safetensors (single file or sharded) + tokenizer files.

Import is a rename and a transpose (our Flax modules carry HF's names), checked tensor by tensor
against the param tree the config implies, so that a wrong or partial checkpoint fails with one
message naming every problem rather than with a shape error deep inside jax.

Tied embeddings (`tie_word_embeddings`) with a stored `lm_head.weight` follow transformers 5: a copy
equal to the embedding is dropped, a lone copy is the embedding, and a different one unties the model.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.config import ModelConfig, config_from_hf, generation_eos_ids, merge_ids, read_hf_config
from parse_jax.models.model import Model, ParamPath, expected_params, unflatten
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.utils.progress import bar

SINGLE_FILE = "model.safetensors"
EMBED = "model.embed_tokens.weight"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype tag -> numpy dtype (little-endian, as the format stores them)
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}
# Non-parameter buffers some exporters store (e.g. `model.layers.0.self_attn.rotary_emb.inv_freq`).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

def hf_name(path: ParamPath) -> tuple[str, bool]:
    """HF tensor name of a Flax param path, and whether the tensor is stored transposed ([out, in])."""
    *modules, leaf = path
    parts = [m.replace("layers_", "layers.", 1) if m.startswith("layers_") else m for m in modules]
    name = ".".join(parts) + (".bias" if leaf == "bias" else ".weight")
    return (name if modules[0] == "lm_head" else "model." + name), leaf == "kernel"


# ---------------------------------------------------------------------------------------- reading


class _Entry:
    """One tensor of a safetensors file: its name, file, dtype tag and shape (read through `safetensors`)."""

    def __init__(self, file: Path, name: str, dtype: str, shape: list[int]) -> None:
        self.file, self.name, self.dtype, self.shape = file, name, dtype, shape

    def read(self) -> np.ndarray:
        """The whole tensor (safetensors' numpy framework gives bfloat16 as `ml_dtypes.bfloat16`)."""
        return self.read_slice(())

    def read_slice(self, index: tuple[slice, ...]) -> np.ndarray:
        """Only the rows/columns `index` selects: what one device of a mesh needs."""
        try:
            with safetensors.safe_open(str(self.file), framework="numpy") as f:
                array = f.get_slice(self.name)[index] if index else f.get_tensor(self.name)
        except Exception as e:  # SafetensorError, OSError: a file changed or damaged since its header was read
            raise CheckpointError(f"cannot read tensor {self.name} from {self.file}: {e}") from None
        if array.dtype.kind == "V" and self.dtype == "BF16":  # older safetensors: raw 2-byte records
            array = array.view(ml_dtypes.bfloat16)
        return array

    def raw(self) -> bytes:
        return self.read().tobytes()


def _read_header(path: Path) -> dict[str, _Entry]:
    """Index a safetensors file; the library checks the header, the offsets and the file size."""
    if not path.is_file():
        raise CheckpointError(f"safetensors file not found: {path}")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            entries = {}
            for name in f.keys():
                info = f.get_slice(name)
                entries[name] = _Entry(path, name, info.get_dtype(), list(info.get_shape()))
    except Exception as e:  # SafetensorError and friends: all mean a broken file
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return entries


def read_safetensors(folder: str | Path) -> dict[str, _Entry]:
    """Every tensor of a HF folder: `model.safetensors`, or the shards `model.safetensors.index.json` lists."""
    folder = Path(folder)
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return _read_header(single)
    if not index.is_file():
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (found: {found or 'nothing'}); "
                              "only safetensors checkpoints are supported")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e!r}") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise CheckpointError(f"{index} lists shard files that are missing from {folder}: {missing}")
    entries: dict[str, _Entry] = {}
    for name in files:
        for tensor, entry in _read_header(folder / name).items():
            if tensor in entries:
                raise CheckpointError(f"tensor {tensor} is stored twice: in {entries[tensor].file.name} and {name}")
            entries[tensor] = entry
    not_found = sorted(t for t, f in weight_map.items() if t not in entries or entries[t].file.name != f)
    if not_found:
        raise CheckpointError(f"{index} lists tensors that are not in the named shard: {not_found}")
    return entries


def _describe(entry: _Entry) -> str:
    return f"{entry.dtype}{entry.shape} in {entry.file.name}"


def resolve_tied(cfg: ModelConfig, entries: dict[str, _Entry]) -> tuple[ModelConfig, dict[str, _Entry]]:
    """Tied config with a stored `lm_head.weight`: do what transformers 5 does. Equal to the embedding:
    dropped; the only copy stored: used as the embedding; different: the model is untied (with a warning)."""
    if not cfg.tie_word_embeddings or "lm_head.weight" not in entries:
        return cfg, entries
    entries = dict(entries)
    head = entries.pop("lm_head.weight")
    embed = entries.get(EMBED)
    if embed is None:
        entries[EMBED] = head
        return cfg, entries
    if (head.dtype, head.shape) == (embed.dtype, embed.shape) and head.raw() == embed.raw():
        return cfg, entries
    warnings.warn(f"config.json ties the embeddings but lm_head.weight ({_describe(head)}) differs from {EMBED}; "
                  "loading them untied, as transformers does", stacklevel=3)
    entries["lm_head.weight"] = head
    return cfg.replace(tie_word_embeddings=False), entries


def params_from_safetensors(entries: dict[str, _Entry], cfg: ModelConfig, check_finite: bool = True,
                            where: str = "", shardings: dict[ParamPath, Any] | None = None) -> dict[str, Any]:
    """Map HF tensors onto the param tree of `cfg`, cast to `cfg.dtype`.

    Every name, shape and dtype is checked before any data is read; all problems go into one error.
    `shardings` (param path -> Sharding): each array is built by `jax.make_array_from_callback`, so every device
    reads only its own slice of the file (an 8B+ target never sits whole on one device or in host memory)."""
    expected = expected_params(cfg)
    wanted = {hf_name(path)[0]: path for path in expected}
    missing = sorted(n for n in wanted if n not in entries)
    ignored = {n for n in entries if _IGNORED.search(n)}
    bad_shape: list[str] = []
    bad_dtype: list[str] = []
    unexpected = sorted(n for n in entries if n not in wanted and n not in ignored)
    for name, path in wanted.items():
        entry = entries.get(name)
        if entry is None:
            continue
        shape = list(expected[path].shape)
        if hf_name(path)[1]:
            shape = shape[::-1]
        if entry.shape != shape:
            bad_shape.append(f"{name}: expected {shape}, found {_describe(entry)}")
        if entry.dtype not in _ST_DTYPES:
            bad_dtype.append(f"{name}: {_describe(entry)} (supported: {', '.join(_ST_DTYPES)})")
    if missing or unexpected or bad_shape or bad_dtype:
        lines = [f"checkpoint {where} does not match its config ({cfg.architecture}, {cfg.num_layers} layers, "
                 f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, tied embeddings {cfg.tie_word_embeddings}):"]
        for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                             ("wrong shapes", bad_shape), ("unsupported dtypes", bad_dtype)):
            if items:
                lines.append(f"  {title} ({len(items)}): " + "; ".join(items))
        raise CheckpointError("\n".join(lines))

    target = np.dtype(jnp.dtype(cfg.dtype))
    flat: dict[ParamPath, Any] = {}
    non_finite = []
    for name, path in bar(len(wanted), f"reading {where or 'safetensors'}", iterable=wanted.items(), unit="tensor"):
        entry, transpose = entries[name], hf_name(path)[1]
        if shardings is not None:
            flat[path] = _sharded_read(entry, transpose, expected[path].shape, shardings[path], target,
                                       non_finite if check_finite else None)
            continue
        array = entry.read()
        if check_finite and not np.isfinite(array).all():
            non_finite.append(f"{name} ({entry.file.name})")
            continue
        if transpose:
            array = array.T
        flat[path] = jnp.asarray(array.astype(target))
    if non_finite:
        raise CheckpointError(f"checkpoint {where} has non-finite values (inf/nan) in: {', '.join(non_finite)}")
    return unflatten(flat)


def _sharded_read(entry: _Entry, transpose: bool, shape: tuple[int, ...], sharding: Any, target: np.dtype,
                  non_finite: list[str] | None) -> jax.Array:
    """One param as a global array whose every shard is read straight from its slice of the file."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index)
        part = entry.read_slice(index[::-1] if transpose else index)
        if non_finite is not None and not np.isfinite(part).all():
            label = f"{entry.name} ({entry.file.name})"
            if label not in non_finite:
                non_finite.append(label)
        return np.ascontiguousarray((part.T if transpose else part).astype(target))

    return jax.make_array_from_callback(tuple(shape), sharding, read)


def check_vocab(tokenizer: Tokenizer, cfg: ModelConfig) -> None:
    """A tokenizer that can emit ids past the embedding would index out of bounds at run time."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"tokenizer vocabulary ({tokenizer.vocab_size} tokens, {tokenizer.source}) is larger "
                              f"than the model's embedding ({cfg.vocab_size} rows)")


def read_hf_folder(folder: str | Path, dtype: str | None = None) -> tuple[ModelConfig, Tokenizer, dict[str, _Entry]]:
    """Config, tokenizer and tensor index of a HF folder; reads no tensor data. The config's stop ids are
    config.json's `eos_token_id`, generation_config.json's and the tokenizer's EOS, merged (HF's generate stops
    at generation_config.json's)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    cfg = read_hf_config(folder / "config.json", dtype)
    tokenizer = Tokenizer.from_folder(folder)
    check_vocab(tokenizer, cfg)
    stops = merge_ids(cfg.eos_token_ids, generation_eos_ids(folder, cfg.vocab_size), [tokenizer.eos_id])
    cfg = cfg.replace(eos_token_ids=stops)
    cfg, entries = resolve_tied(cfg, read_safetensors(folder))
    return cfg, tokenizer, entries


def load_hf(folder: str | Path, dtype: str | None = None, check_finite: bool = True,
            attention_impl: str = "xla") -> Model:
    """Load a HF folder (config.json, safetensors, tokenizer.json) as a `Model` in `dtype`
    (default: config.json's dtype when bfloat16, else float32)."""
    cfg, tokenizer, entries = read_hf_folder(folder, dtype)
    params = params_from_safetensors(entries, cfg, check_finite, where=str(folder))
    return Model(cfg, params, tokenizer, attention_impl)


def load_hf_sharded(folder: str | Path, mesh: Any, rules: Any = None, dtype: str | None = None,
                    check_finite: bool = True, attention_impl: str = "xla", fallback_replicated: bool = False) -> Model:
    """A HF folder straight into `mesh`: each device reads only its shard of every tensor (`get_slice`) with
    the shardings of `parse_jax.distributed` (`rules` default: `fitting_rules`). Returns a `ShardedModel`."""
    from parse_jax.distributed.sharded import ShardedModel
    from parse_jax.models.sharding import fitting_rules, param_shardings

    cfg, tokenizer, entries = read_hf_folder(folder, dtype)
    rules = rules or fitting_rules(cfg, mesh, fallback_replicated)
    tree = param_shardings(cfg, mesh, rules)
    shardings = {tuple(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(tree)[0]}
    params = params_from_safetensors(entries, cfg, check_finite, where=str(folder), shardings=shardings)
    return ShardedModel(cfg, params, tokenizer, attention_impl, mesh, rules)


# ---------------------------------------------------------------------------------------- export


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for `cfg`; refuses configs that HF's classes cannot express (read back to check)."""
    attention_bias = cfg.qkv_bias if cfg.architecture != "qwen2" else False
    d: dict[str, Any] = {
        "architectures": [_HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1
                         else cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
        "torch_dtype": cfg.dtype,
        "dtype": cfg.dtype,
    }
    if cfg.rope_type == "llama3":
        factor, low, high, old_len = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                             "high_freq_factor": high, "original_max_position_embeddings": int(old_len)}
    elif cfg.rope_type == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_scaling[0]}
    elif cfg.rope_type == "yarn":
        factor, old_len, beta_fast, beta_slow, attention, truncate = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(old_len),
                             "beta_fast": beta_fast, "beta_slow": beta_slow, "attention_factor": attention,
                             "truncate": bool(truncate)}
    back = config_from_hf(d, cfg.dtype)
    if back != cfg:
        diff = {f: (getattr(cfg, f), getattr(back, f)) for f in cfg.to_dict() if getattr(cfg, f) != getattr(back, f)}
        raise ConfigError(f"this config cannot be written as a HF {cfg.architecture} config.json: "
                          f"fields (ours, HF's) differ: {diff}")
    return d


def export_hf(model: Model, folder: str | Path, dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write `model` as a HF folder (config.json, model.safetensors, the tokenizer's files and the
    generation_config.json it was loaded with, if any), loadable by `load_hf` and by `transformers` (and so by
    vLLM). Written whole or not at all (a temporary folder renamed into place); an existing `folder` is an error
    unless `overwrite`."""
    from parse_jax.checkpoints.save_path import check_save_path
    from parse_jax.utils.atomic import replacing

    check_save_path(folder, overwrite)  # before a tensor is converted
    cfg = model.config if dtype is None else model.config.replace(dtype=dtype)
    config = hf_config_dict(cfg)
    target = np.dtype(jnp.dtype(cfg.dtype))
    tensors = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        name, transpose = hf_name(tuple(k.key for k in path))
        array = np.asarray(leaf).astype(target)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    folder = Path(folder)
    with replacing(folder) as tmp:
        tmp.mkdir()
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        safetensors.numpy.save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    return folder

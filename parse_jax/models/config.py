"""One config for the whole decoder family (Llama-3, Qwen2/2.5, Qwen3), read from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.utils.validation import check_float, check_int

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "llama3", "linear", "yarn")
# How many numbers `ModelConfig.rope_scaling` holds for each rope type (see the field's comment).
_ROPE_LEN = {"default": 0, "linear": 1, "llama3": 4, "yarn": 6}
# Logit of vocabulary rows at or past `ModelConfig.vocab_limit`: far below any real logit, so softmax gives them
# exactly 0 and argmax never picks them, yet finite (no inf - inf = nan in log-softmax or temperature scaling).
MASKED_LOGIT = -1e9


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the Flax decoder needs; hashable so it can be a static jit argument."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) for llama3;
    # (factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate 0/1) for yarn;
    # (factor,) for linear; () for default.
    rope_scaling: tuple[float, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    bos_token_id: int | None = None
    # Every stop id: config.json's eos_token_id, generation_config.json's and the tokenizer's EOS (HF folders).
    eos_token_ids: tuple[int, ...] = ()
    # Rows >= vocab_limit are embedding padding (a pair padded to one size by `vocab.align_vocab`): the decoder
    # gives them MASKED_LOGIT so they are never sampled. None: every row is a real token.
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        check_float("config field rms_norm_eps", self.rms_norm_eps, 0.0, min_open=True)
        check_float("config field rope_theta", self.rope_theta, 0.0, min_open=True)
        if len(self.rope_scaling) != _ROPE_LEN[self.rope_type]:
            raise ConfigError(f"config field rope_scaling must hold {_ROPE_LEN[self.rope_type]} numbers for rope "
                              f"type {self.rope_type!r}, got {self.rope_scaling!r}")
        for i, value in enumerate(self.rope_scaling):
            check_float(f"config field rope_scaling[{i}] ({self.rope_type})", value,
                        0.0, min_open=not (self.rope_type == "yarn" and i == 5))
        if self.vocab_limit is not None:
            check_int("config field vocab_limit", self.vocab_limit, 1, self.vocab_size)
        if self.bos_token_id is not None:
            check_int("config field bos_token_id", self.bos_token_id, 0, self.vocab_size - 1)
        for value in self.eos_token_ids:
            check_int("config field eos_token_ids (an id)", value, 0, self.vocab_size - 1)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        per_layer = attn + 3 * h * i + (2 * i + h) * self.mlp_bias + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @property
    def real_vocab_size(self) -> int:
        """Rows that are real tokens (the rest, if any, are padding the decoder masks)."""
        return self.vocab_size if self.vocab_limit is None else self.vocab_limit

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = list(self.rope_scaling)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(f"unknown model config fields: {unknown}")
        d = dict(d)
        d["rope_scaling"] = tuple(float(x) for x in d.get("rope_scaling", ()))
        d["eos_token_ids"] = tuple(int(x) for x in d.get("eos_token_ids", ()))
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"invalid model config: {e}") from None

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_NAMES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _field(d: dict[str, Any], key: str, kind: type, default: Any = None, minimum: float | None = None,
           where: str = "config.json field") -> Any:
    """d[key] as an int or a finite float >= `minimum` (floats: > minimum), else a ConfigError naming the field,
    the value and the allowed range: 7.9 or true is never truncated into a layer count."""
    value = d.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    name = f"{where} {key!r}"
    if kind is int:
        return check_int(name, value, None if minimum is None else int(minimum))
    return check_float(name, value, minimum, min_open=minimum is not None)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, str, tuple[float, ...]]:
    """HF keeps rope settings in `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"config.json rope_scaling / rope_parameters must be objects, got {scaling!r} / {params!r}")
    merged = scaling or params  # transformers: `rope_parameters = rope_scaling or rope_parameters`, not a merge
    theta = _field({**d, **merged}, "rope_theta", float, 10000.0, minimum=0.0)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    where = f"config.json rope_scaling ({kind}) field"
    if kind == "default":
        return theta, "default", ()
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if merged.get(key) is None:
                raise ConfigError(f"llama3 rope scaling is missing field {key!r}")
        low = _field(merged, "low_freq_factor", float, minimum=0.0, where=where)
        high = _field(merged, "high_freq_factor", float, minimum=0.0, where=where)
        if high <= low:
            raise ConfigError(f"{where} 'high_freq_factor' ({high:g}) must be greater than 'low_freq_factor' "
                              f"({low:g})")
        return theta, "llama3", (_field(merged, "factor", float, minimum=0.0, where=where), low, high,
                                 float(_field(merged, "original_max_position_embeddings", int, minimum=1,
                                              where=where)))
    if kind == "linear":
        return theta, "linear", (_field(merged, "factor", float, minimum=0.0, where=where),)
    if kind == "yarn":
        return theta, "yarn", _yarn_from_hf(d, merged, where)
    raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")


def _yarn_from_hf(d: dict[str, Any], merged: dict[str, Any], where: str) -> tuple[float, ...]:
    """yarn's numbers resolved as transformers' `_compute_yarn_parameters` resolves them (defaults, attention
    factor from mscale / mscale_all_dim), so the config holds exactly what the decoder uses."""
    old_len = d.get("original_max_position_embeddings", merged.get("original_max_position_embeddings"))
    old_len = _field({"original_max_position_embeddings": old_len}, "original_max_position_embeddings", int,
                     d.get("max_position_embeddings") or 4096, minimum=1, where=where)
    if merged.get("factor") is None:
        factor = _field(d, "max_position_embeddings", int, 4096, minimum=1) / old_len
    else:
        factor = _field(merged, "factor", float, minimum=0.0, where=where)
    beta_fast = _field(merged, "beta_fast", float, None, where=where) if merged.get("beta_fast") else 32.0
    beta_slow = _field(merged, "beta_slow", float, None, where=where) if merged.get("beta_slow") else 1.0
    if merged.get("attention_factor") is not None:
        attention = _field(merged, "attention_factor", float, minimum=0.0, where=where)
    else:
        mscale, mscale_all = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attention = _yarn_mscale(factor)
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where} 'truncate' must be true or false, got {truncate!r}")
    return (factor, float(old_len), beta_fast, beta_slow, attention, float(truncate))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _token_ids(d: dict[str, Any], key: str, source: str = "config.json") -> tuple[int, ...]:
    """An id, a list of ids, or null; anything else is refused by name."""
    value = d.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(check_int(f"{source} field {key!r}", x, 0) for x in values)


def config_from_hf(d: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Translate a HF `config.json` dict; unknown architectures are refused by name, and every number is checked
    (integers really integers, positive sizes, rope_theta / rms_norm_eps / factors > 0, token ids in the vocab)."""
    model_type = d.get("model_type")
    arch = _MODEL_TYPES.get(model_type)
    if arch is None:
        names = d.get("architectures") or []
        arch = next((_ARCH_NAMES[n] for n in names if n in _ARCH_NAMES), None)
    if arch is None:
        raise ConfigError(
            f"unknown architecture (model_type={model_type!r}, architectures={d.get('architectures')!r}); "
            f"supported model types: {', '.join(_MODEL_TYPES)}")
    if d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or []):
        raise ConfigError("sliding-window attention (use_sliding_window / layer_types sliding_attention) "
                          "is not supported")
    hidden = _field(d, "hidden_size", int, minimum=1)
    heads = _field(d, "num_attention_heads", int, minimum=1)
    vocab = _field(d, "vocab_size", int, minimum=1)
    theta, rope_type, rope_scaling = _rope_from_hf(d)
    eos_ids = _token_ids(d, "eos_token_id")
    bos = _token_ids(d, "bos_token_id")
    for key, ids in (("bos_token_id", bos), ("eos_token_id", eos_ids)):
        for x in ids:
            if x >= vocab:
                raise ConfigError(f"config.json field {key!r} is {x}, outside the vocabulary: allowed 0..{vocab - 1} "
                                  f"(vocab_size {vocab})")
    if len(bos) > 1:
        raise ConfigError(f"config.json field 'bos_token_id' must be one id, got {d.get('bos_token_id')!r}")
    if dtype is None:
        dtype = {"bfloat16": "bfloat16"}.get(str(d.get("torch_dtype", d.get("dtype", "float32"))), "float32")
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_field(d, "intermediate_size", int, minimum=1),
        num_layers=_field(d, "num_hidden_layers", int, minimum=1),
        num_heads=heads,
        num_kv_heads=_field(d, "num_key_value_heads", int, heads, minimum=1),
        head_dim=_field(d, "head_dim", int, hidden // heads, minimum=1),
        rms_norm_eps=_field(d, "rms_norm_eps", float, 1e-6, minimum=0.0),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=_field(d, "max_position_embeddings", int, 4096, minimum=1),
        dtype=dtype,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos_ids,
    )


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object, or a ConfigError naming the file."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} is not valid JSON ({path}): {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{what} must hold a JSON object: {path}")
    return d


def read_hf_config(path: str | Path, dtype: str | None = None) -> ModelConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config.json not found: {path}")
    return config_from_hf(read_json_object(path, "config.json"), dtype)


def generation_eos_ids(folder: str | Path, vocab_size: int) -> tuple[int, ...]:
    """The stop ids of a HF folder's `generation_config.json` (an id or a list; () when there is no file):
    transformers' `generate` stops at these, e.g. Qwen's second stop id `<|endoftext|>`."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    ids = _token_ids(read_json_object(path, "generation_config.json"), "eos_token_id", "generation_config.json")
    for x in ids:
        if x >= vocab_size:
            raise ConfigError(f"generation_config.json field 'eos_token_id' is {x}, outside the vocabulary: "
                              f"allowed 0..{vocab_size - 1} ({path})")
    return ids


def merge_ids(*groups: Any) -> tuple[int, ...]:
    """Ids of every group in first-seen order, None skipped: one stop list from several sources."""
    out: list[int] = []
    for group in groups:
        for x in group:
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies as HF computes them, including llama3's frequency-dependent scaling and yarn's ramp
    between interpolated and extrapolated frequencies."""
    dim = cfg.head_dim
    pos_freqs = (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
    inv = (1.0 / pos_freqs).astype(np.float32)
    if cfg.rope_type == "linear":
        inv = inv / np.float32(cfg.rope_scaling[0])
    elif cfg.rope_type == "llama3":
        factor, low, high, old_len = cfg.rope_scaling
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif cfg.rope_type == "yarn":
        factor, old_len, beta_fast, beta_slow, _, truncate = cfg.rope_scaling

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = (1 - ramp).astype(np.float32)
        interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (interpolation * (1 - extrapolation) + inv * extrapolation).astype(np.float32)
    return inv


def rope_attention_scaling(cfg: ModelConfig) -> float:
    """Factor on cos/sin (transformers' `attention_scaling`): yarn's attention factor, else 1."""
    return cfg.rope_scaling[4] if cfg.rope_type == "yarn" else 1.0

"""One config for the whole decoder family (Llama-3, Qwen2/2.5, Qwen3), read from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from parse_jax.errors import ConfigError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "llama3", "linear")


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
    eos_token_ids: tuple[int, ...] = ()

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
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
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


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, str, tuple[float, ...]]:
    """HF keeps rope settings in `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = _number({**d, **merged}, "rope_theta", float, 10000.0)
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return theta, "default", ()
    if kind == "llama3":
        try:
            return theta, "llama3", (float(merged["factor"]), float(merged["low_freq_factor"]),
                                     float(merged["high_freq_factor"]),
                                     float(merged["original_max_position_embeddings"]))
        except KeyError as e:
            raise ConfigError(f"llama3 rope scaling is missing field {e.args[0]!r}") from None
    if kind == "linear":
        return theta, "linear", (float(merged["factor"]),)
    raise ConfigError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")


def _number(d: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    """d[key] as int/float, or a ConfigError naming the field."""
    value = d.get(key)
    value = default if value is None else value
    if value is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config.json field {key!r} must be a number, got {value!r}") from None


def config_from_hf(d: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Translate a HF `config.json` dict; unknown architectures are refused by name."""
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
    hidden = _number(d, "hidden_size", int)
    heads = _number(d, "num_attention_heads", int)
    theta, rope_type, rope_scaling = _rope_from_hf(d)
    eos = d.get("eos_token_id")
    try:
        eos_ids = tuple(int(x) for x in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    except (TypeError, ValueError):
        raise ConfigError(f"config.json field 'eos_token_id' must be an id or a list of ids, got {eos!r}") from None
    if dtype is None:
        dtype = {"bfloat16": "bfloat16"}.get(str(d.get("torch_dtype", d.get("dtype", "float32"))), "float32")
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=_number(d, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_number(d, "intermediate_size", int),
        num_layers=_number(d, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_number(d, "num_key_value_heads", int, heads),
        head_dim=_number(d, "head_dim", int, hidden // heads if heads else None),
        rms_norm_eps=_number(d, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=rope_scaling,
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=_number(d, "max_position_embeddings", int, 4096),
        dtype=dtype,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def read_hf_config(path: str | Path, dtype: str | None = None) -> ModelConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config.json not found: {path}")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config.json is not valid JSON ({path}): {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config.json must hold a JSON object: {path}")
    return config_from_hf(d, dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies as HF computes them, including llama3's frequency-dependent scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    inv = inv.astype(np.float32)
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
    return inv

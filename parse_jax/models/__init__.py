"""Flax decoder family (Llama, Qwen2, Qwen3), KV cache, HF import, Orbax I/O."""

from parse_jax.models.checkpoint import convert_hf, load_model, save_model
from parse_jax.models.hf_import import export_hf, load_hf
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.models.vocab import align_vocab

__all__ = ["Tokenizer", "align_vocab", "convert_hf", "export_hf", "load_hf", "load_model", "save_model"]

"""parse-jax: PARSE parallel prefix verification for speculative generation, in JAX/Flax."""

from parse_jax.errors import CheckpointError, ConfigError, InputError, ParseJaxError
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model

__all__ = ["CheckpointError", "ConfigError", "InputError", "Model", "ModelConfig", "ParseJaxError"]

"""parse-jax: PARSE parallel prefix verification for speculative generation, in JAX/Flax."""

from parse_jax.decode import GenerateResult, generate
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import CheckpointError, ConfigError, InputError, ParseJaxError
from parse_jax.models.checkpoint import load_model, save_model
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.pair import load_pair
from parse_jax.speculative import speculative_generate
from parse_jax.tasks import load_task

__all__ = ["CheckpointError", "ConfigError", "GenerateResult", "InputError", "Model", "ModelConfig",
           "ParseConfig", "ParseEngine", "ParseJaxError", "generate", "load_model", "load_pair", "load_task",
           "save_model", "speculative_generate"]

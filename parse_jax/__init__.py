"""parse-jax: PARSE parallel prefix verification for speculative generation, in JAX/Flax."""

from parse_jax.decode import GenerateResult, generate
from parse_jax.distributed import load_sharded, make_mesh, shard_model
from parse_jax.eagle3 import Eagle3, eagle3_generate, load_eagle3, save_eagle3
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import CheckpointError, ConfigError, InputError, ParseJaxError
from parse_jax.models.checkpoint import load_model, save_model
from parse_jax.models.config import ModelConfig
from parse_jax.models.model import Model
from parse_jax.pair import load_pair
from parse_jax.speculative import speculative_generate
from parse_jax.tasks import load_task

__all__ = ["CheckpointError", "ConfigError", "Eagle3", "GenerateResult", "InputError", "Model", "ModelConfig",
           "ParseConfig", "ParseEngine", "ParseJaxError", "eagle3_generate", "generate", "load_eagle3", "load_model",
           "load_pair", "load_sharded", "load_task", "make_mesh", "save_eagle3", "save_model", "shard_model",
           "speculative_generate"]

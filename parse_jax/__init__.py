"""parse-jax: PARSE parallel prefix verification for speculative generation, in JAX/Flax.

The public names are imported on first use (PEP 562), so `import parse_jax` and `parse-jax --help` do not pay for
importing jax; `pj.load_model` etc. behave exactly as plain imports."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from parse_jax.errors import CheckpointError, ConfigError, InputError, ParseJaxError
from parse_jax.utils.version import package_version

__version__ = package_version()

# public name -> the module that defines it
_LAZY = {
    "GenerateResult": "parse_jax.runtime.requests", "generate": "parse_jax.runtime.decode",
    "load_sharded": "parse_jax.checkpoints.load", "make_mesh": "parse_jax.distributed.mesh",
    "shard_model": "parse_jax.distributed.sharded",
    "Eagle3": "parse_jax.speculation.eagle3", "eagle3_generate": "parse_jax.speculation.eagle3",
    "load_eagle3": "parse_jax.speculation.eagle3",
    "save_eagle3": "parse_jax.speculation.eagle3", "export_speculators": "parse_jax.speculation.eagle3",
    "ParseConfig": "parse_jax.settings", "ParseEngine": "parse_jax.engine",
    "SpecSettings": "parse_jax.settings", "Eagle3Settings": "parse_jax.settings",
    "align_vocab": "parse_jax.models.vocab",
    "EvalResult": "parse_jax.harness.eval.evaluate", "evaluate": "parse_jax.harness.eval.evaluate",
    "load_model": "parse_jax.checkpoints.load", "save_model": "parse_jax.checkpoints.orbax",
    "export_hf": "parse_jax.checkpoints.hf",
    "ModelConfig": "parse_jax.models.config", "Model": "parse_jax.models.model",
    "load_pair": "parse_jax.checkpoints.pair", "speculative_generate": "parse_jax.speculation.draft_model",
    "load_task": "parse_jax.tasks",
}

if TYPE_CHECKING:
    from parse_jax.checkpoints.hf import export_hf
    from parse_jax.checkpoints.load import load_model, load_sharded
    from parse_jax.checkpoints.orbax import save_model
    from parse_jax.checkpoints.pair import load_pair
    from parse_jax.distributed.mesh import make_mesh
    from parse_jax.distributed.sharded import shard_model
    from parse_jax.engine import ParseEngine
    from parse_jax.harness.eval.evaluate import EvalResult, evaluate
    from parse_jax.models.config import ModelConfig
    from parse_jax.models.model import Model
    from parse_jax.models.vocab import align_vocab
    from parse_jax.runtime.decode import generate
    from parse_jax.runtime.requests import GenerateResult
    from parse_jax.settings import Eagle3Settings, ParseConfig, SpecSettings
    from parse_jax.speculation.draft_model import speculative_generate
    from parse_jax.speculation.eagle3 import Eagle3, eagle3_generate, export_speculators, load_eagle3, save_eagle3
    from parse_jax.tasks import load_task


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'parse_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["CheckpointError", "ConfigError", "Eagle3", "Eagle3Settings", "EvalResult", "GenerateResult", "InputError",
           "Model", "ModelConfig", "ParseConfig", "ParseEngine", "ParseJaxError", "SpecSettings", "align_vocab",
           "eagle3_generate", "evaluate", "export_hf", "export_speculators", "generate", "load_eagle3", "load_model",
           "load_pair", "load_sharded", "load_task", "make_mesh", "save_eagle3", "save_model", "shard_model",
           "speculative_generate"]

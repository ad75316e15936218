"""`attention_impl` choices, their errors, and the engine's prefix scores through the kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model, tiny_config


@pytest.mark.parametrize("impl,backend,expect", [
    ("auto", "cpu", ("xla", False)),
    ("auto", "gpu", ("pallas_gpu", False)),
    ("auto", "tpu", ("pallas_tpu", False)),
    ("pallas", "cpu", ("pallas_gpu", True)),
    ("pallas", "tpu", ("pallas_tpu", False)),
    ("pallas_tpu", "cpu", ("pallas_tpu", True)),
    ("pallas_gpu", "tpu", ("pallas_gpu", True)),
    ("xla", "gpu", ("xla", False)),
])
def test_resolve(impl, backend, expect):
    assert pallas_kernels.resolve(impl, backend) == expect


def test_interpret_switch_forces_the_interpreter():
    assert pallas_kernels.resolve("pallas", "gpu", interpret=True) == ("pallas_gpu", True)
    with pytest.raises(ValueError, match="cannot be compiled on a 'cpu' backend"):
        pallas_kernels.resolve("pallas_tpu", "cpu", interpret=False)


def test_unknown_impl_is_a_clear_error():
    x = jnp.zeros((1, 1, 1, 16))
    meta = jnp.ones((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="unknown attention_impl 'flash'; available: xla, pallas, auto"):
        pallas_kernels.attention(x, x, x, jnp.zeros(1, jnp.int32), meta, meta, impl="flash")
    with pytest.raises(ConfigError, match="unknown attention_impl 'triton'"):
        Model(tiny_config("qwen3"), {}, attention_impl="triton")


def test_engine_prefix_scores_match_through_the_kernel():
    """One verification pass of a random qwen3 target: "pallas" (on CPU: the GPU-style kernel, interpreted)
    gives the XLA path's scores. The TPU kernel is checked against the reference in test_kernels.py."""
    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    target = random_model("qwen3", 40, vocab_size=tok.vocab_size, num_layers=1)  # one layer: interpreters are slow
    rng = np.random.default_rng(3)
    ctx, drafted = rng.integers(0, tok.vocab_size, 7).tolist(), rng.integers(0, tok.vocab_size, 13).tolist()
    bounds = [3, 8, 13]
    scores = {}
    for impl in ("xla", "pallas"):
        t = Model(target.config, target.params, tok, attention_impl=impl)  # prefix_scores uses the target only
        scores[impl] = ParseEngine(t, t, ParseConfig(max_draft_tokens=12)).prefix_scores(ctx, drafted, bounds)
    assert np.isfinite(scores["xla"]).all() and np.ptp(scores["xla"]) > 0
    np.testing.assert_allclose(scores["pallas"], scores["xla"], rtol=0, atol=1e-5)

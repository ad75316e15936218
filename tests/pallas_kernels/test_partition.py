"""The kernels under `shard_map` on a mesh: each device's rows and heads give the unpartitioned result.

Run on 8 fake CPU devices (a subprocess: the device count is fixed when jax starts) with the reference attention
standing in for the compiled kernel (`partitioned` takes any kernel of the same contract), GQA 8 query / 4 KV heads."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from pallas_kernels.partition import free_axes, needs_partition, out_struct, partitioned
from pallas_kernels.reference import attention_reference

b, t, h, kv, s, d = 4, 6, 8, 4, 16, 8
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
k = jnp.asarray(rng.normal(size=(b, kv, s, d)), jnp.float32)
v = jnp.asarray(rng.normal(size=(b, kv, s, d)), jnp.float32)
lengths = jnp.asarray([3, 5, 0, 7], jnp.int32)
limit = jnp.asarray(rng.integers(0, t + 1, size=(b, t)), jnp.int32)
group = jnp.asarray(rng.integers(0, 3, size=(b, t)), jnp.int32)
want = attention_reference(q, k, v, lengths, limit, group)
out = {}
for shape in ((2, 4), (4, 2), (8, 1), (1, 8)):
    mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        assert needs_partition() and free_axes() == {"data": shape[0], "model": shape[1]}
        got = jax.jit(lambda *a: partitioned(attention_reference, *a))(q, k, v, lengths, limit, group)
    out[str(shape)] = float(jnp.max(jnp.abs(got - want)))
assert not needs_partition()
assert out_struct((2, 3), jnp.float32, q).shape == (2, 3)
print(json.dumps(out))
"""


@pytest.mark.subprocess
def test_partitioned_attention_equals_the_whole_on_every_mesh_shape():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(diffs) == {"(2, 4)", "(4, 2)", "(8, 1)", "(1, 8)"}
    assert max(diffs.values()) < 1e-6, diffs

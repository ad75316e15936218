"""Block sizes per chip: the tiles each TPU generation and GPU gets, and the shapes no tile fits."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.tiles import (
    SCOPED_VMEM,
    TileError,
    Tiles,
    gpu_shared_bytes,
    gpu_tiles,
    target_device_kind,
    target_platform,
    tiles_for,
    tpu_tiles,
    tpu_vmem_bytes,
)


def _on(kind: str, platform: str = "tpu", cores: int = 1):
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
    return use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def test_the_target_platform_is_the_abstract_mesh_s_device_else_this_machine():
    assert target_platform() == jax.default_backend()
    with _on("TPU v6 lite"):
        assert (target_platform(), target_device_kind()) == ("tpu", "TPU v6 lite")
    with _on("NVIDIA H200", "cuda"):
        assert target_platform() == "gpu"


@pytest.mark.parametrize("kind,cores,expect", [
    ("TPU v4", 2, Tiles(128, 512)), ("TPU v5 lite", 1, Tiles(128, 512)), ("TPU v5", 2, Tiles(128, 512)),
    ("TPU v6 lite", 1, Tiles(256, 512)),
])
def test_each_tpu_generation_gets_its_tiles(kind, cores, expect):
    """A 576-token verification block over a 4096-slot cache, head_dim 128 in bfloat16 (a Qwen3-8B pass)."""
    with _on(kind, cores=cores):
        assert tiles_for("pallas_tpu", 576, 4096, 128, jnp.bfloat16) == expect


def test_short_passes_and_short_caches_take_small_tpu_blocks():
    assert tpu_tiles(1, 256, 128, jnp.bfloat16, generation=5, mxu=128) == Tiles(128, 128)
    assert tpu_tiles(1, 256, 128, jnp.bfloat16, generation=6, mxu=256) == Tiles(128, 256)  # v6e's wide MXU
    assert tpu_tiles(1, 1024, 64, jnp.float32, generation=5, mxu=128) == Tiles(128, 256)


def test_every_tpu_tile_fits_the_scoped_vmem_and_lanes():
    for gen, limit in SCOPED_VMEM.items():
        for d in (64, 128, 256, 512, 1024):
            t = tpu_tiles(4096, 65536, d, jnp.float32, generation=gen, mxu=128)
            assert t.block_q % 128 == 0 and t.block_k % 128 == 0
            assert tpu_vmem_bytes(t.block_q, t.block_k, d, jnp.float32) <= limit


def test_a_head_no_tpu_tile_holds_is_refused():
    with pytest.raises(TileError, match=r"head_dim 8192 \(float32\) needs .* MiB of VMEM for the smallest TPU tile "
                                        r"\(128 x 128\); the scoped VMEM limit of a v5 chip is 16 MiB"):
        tpu_tiles(128, 128, 8192, jnp.float32, generation=5, mxu=128)


def test_an_unknown_tpu_is_refused():
    with _on("TPU v1"), pytest.raises(TileError, match="cannot tile for TPU device kind 'TPU v1'"):
        tiles_for("pallas_tpu", 8, 128, 128, jnp.bfloat16)


def test_gpu_tiles_follow_the_head_and_the_shared_memory():
    assert gpu_tiles(576, 128, jnp.bfloat16, shared_memory=227 << 10) == Tiles(128, 64, 8, 3)
    assert gpu_tiles(1, 64, jnp.bfloat16, shared_memory=227 << 10) == Tiles(16, 64, 4, 3)  # decode: one query
    small = gpu_tiles(576, 256, jnp.float32, shared_memory=99 << 10)  # a wide float32 head on a small part
    assert small.num_stages == 1 and gpu_shared_bytes(small.block_q, small.block_k, 256, 1, 4) <= 99 << 10
    with _on("NVIDIA H100 80GB HBM3", "cuda"):
        assert tiles_for("pallas_gpu", 576, 4096, 128, jnp.bfloat16).num_stages == 3


def test_a_head_the_triton_kernel_cannot_hold_is_refused():
    with pytest.raises(TileError, match=r"head_dim 512 cannot be tiled by the Triton kernel: .* must be in \[1, 256\]"):
        gpu_tiles(64, 512, jnp.bfloat16, shared_memory=227 << 10)
    with pytest.raises(TileError, match=r"head_dim 256 \(float32\) needs more shared memory than the GPU's 16 KiB"):
        gpu_tiles(64, 256, jnp.float32, shared_memory=16 << 10)

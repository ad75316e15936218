"""Block sizes per chip: the kernels' tiles chosen from the hardware they are compiled for and from head_dim.

The platform and chip are the caller's, not this machine's: inside `jax.sharding.use_abstract_mesh(...)` whose
abstract device names a TPU or a GPU (what `parse_jax.lowering` sets up to lower from a CPU machine), that device;
otherwise jax's default backend and its first device. `target_platform()` says which.

TPU (Mosaic): a tile is a (sublanes x lanes) = (8 x 128) grid of 32-bit words; the kernel's query and key blocks
are whole lane tiles (multiples of 128), wide heads are zero-padded to whole lane tiles, and one grid step's working
set (double-buffered q, k, v and output blocks, the lane-replicated metadata, float32 scratch and the score tile)
must fit the scoped VMEM limit Mosaic compiles under. Larger key blocks amortise the per-step overhead over long
caches; chips whose MXU is 256 wide (v6e) get 256-wide key blocks.

GPU (Triton): blocks are powers of two >= 16 (tensor-core dots); the head is padded to a power of two, and one
program keeps a [block_q, head_dim] float32 accumulator in registers and `num_stages` key/value blocks in shared
memory, which must fit the chip's shared memory per SM.

A shape no tile fits is refused with `TileError` (a ValueError), naming the shape and the limit.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

LANES, SUBLANES = 128, 8
# Mosaic's default scoped VMEM limit per generation (bytes): what a kernel gets without raising it.
SCOPED_VMEM = {4: 16 << 20, 5: 16 << 20, 6: 32 << 20}
GPU_MAX_HEAD_DIM = 256
# Shared memory per SM usable by one Triton program, by device kind prefix (bytes).
GPU_SHARED_MEMORY = {"NVIDIA H100": 227 << 10, "NVIDIA H200": 227 << 10, "NVIDIA H20": 227 << 10,
                     "NVIDIA A100": 163 << 10}
GPU_DEFAULT_SHARED_MEMORY = 99 << 10  # consumer and older data-centre parts


class TileError(ValueError):
    """A kernel shape the target hardware cannot tile."""


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_q: int
    block_k: int
    num_warps: int | None = None  # GPU only
    num_stages: int | None = None  # GPU only


def target_platform() -> str:
    """"tpu", "gpu" or "cpu": the abstract mesh's device when one is set (lowering for another machine), else jax's
    default backend."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        return jax.default_backend()
    return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform


def target_device_kind() -> str:
    """The device kind programs are traced for (the abstract mesh's device, else this machine's first device)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def _itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def tpu_vmem_bytes(block_q: int, block_k: int, head_dim: int, dtype) -> int:
    """VMEM one grid step of the TPU kernel holds: q, k, v, output and metadata blocks double-buffered, the float32
    scratch (m, l, acc) and the float32 score/probability tiles."""
    d = head_dim if head_dim <= LANES else -(-head_dim // LANES) * LANES
    item = _itemsize(dtype)
    blocks = (2 * block_q * d + 2 * block_k * d) * item + (2 * block_q * LANES + SUBLANES * block_k) * 4
    scratch = (2 * block_q * LANES + block_q * d) * 4
    return 2 * blocks + scratch + 3 * block_q * block_k * 4


def tpu_tiles(num_tokens: int, num_slots: int, head_dim: int, dtype, *, generation: int, mxu: int,
              vmem_limit: int | None = None) -> Tiles:
    """The TPU kernel's (block_q, block_k) for T queries over S cache slots on a chip of `generation` whose MXU is
    `mxu` wide; refuses a head_dim whose smallest tile overflows the scoped VMEM limit."""
    if head_dim <= 0 or num_tokens <= 0 or num_slots <= 0:
        raise TileError(f"TPU attention needs positive shapes, got T={num_tokens}, S={num_slots}, "
                        f"head_dim={head_dim}")
    limit = vmem_limit or SCOPED_VMEM.get(generation, 16 << 20)
    smallest = tpu_vmem_bytes(LANES, LANES, head_dim, dtype)
    if smallest > limit:
        raise TileError(f"head_dim {head_dim} ({np.dtype(dtype).name}) needs {smallest / 2**20:.1f} MiB of VMEM "
                        f"for the smallest TPU tile (128 x 128); the scoped VMEM limit of a v{generation} chip is "
                        f"{limit / 2**20:.0f} MiB")
    block_q = 256 if num_tokens >= 256 and mxu >= 256 else LANES
    block_k = 512 if num_slots >= 2048 else (256 if num_slots >= 512 or mxu >= 256 else LANES)
    while tpu_vmem_bytes(block_q, block_k, head_dim, dtype) > limit:
        if block_k > LANES:
            block_k //= 2
        else:
            block_q //= 2
    return Tiles(block_q, block_k)


def gpu_shared_memory(device_kind: str) -> int:
    for prefix, size in GPU_SHARED_MEMORY.items():
        if device_kind.startswith(prefix):
            return size
    return GPU_DEFAULT_SHARED_MEMORY


def gpu_tiles(num_tokens: int, head_dim: int, dtype, *, shared_memory: int) -> Tiles:
    """The Triton kernel's blocks, warps and stages for a head of `head_dim`: refuses heads over 256 (the float32
    accumulator of one program no longer fits its registers) and stages that overflow shared memory."""
    if head_dim <= 0 or head_dim > GPU_MAX_HEAD_DIM:
        raise TileError(f"head_dim {head_dim} cannot be tiled by the Triton kernel: one program holds a "
                        f"[block_q, head_dim] float32 accumulator in registers, so head_dim must be in "
                        f"[1, {GPU_MAX_HEAD_DIM}]")
    d = max(16, 1 << (head_dim - 1).bit_length())
    block_q, block_k, warps = (128, 64, 4) if d <= 64 else ((128, 64, 8) if d <= 128 else (64, 32, 8))
    block_q = min(block_q, max(16, 1 << (max(num_tokens, 1) - 1).bit_length()))
    item = _itemsize(dtype)
    stages = 3 if d <= 128 else 2
    while gpu_shared_bytes(block_q, block_k, d, stages, item) > shared_memory:
        if stages > 1:
            stages -= 1
        elif block_k > 16:
            block_k //= 2
        elif block_q > 16:
            block_q //= 2
        else:
            raise TileError(f"head_dim {head_dim} ({np.dtype(dtype).name}) needs more shared memory than the GPU's "
                            f"{shared_memory >> 10} KiB per SM even for 16 x 16 blocks")
    return Tiles(block_q, block_k, warps, stages)


def gpu_shared_bytes(block_q: int, block_k: int, head_dim: int, stages: int, itemsize: int) -> int:
    """Shared memory of one Triton program: `stages` pipelined key and value blocks and the query block."""
    return (stages * 2 * block_k + block_q) * head_dim * itemsize


def tiles_for(kind: str, num_tokens: int, num_slots: int, head_dim: int, dtype) -> Tiles:
    """Tiles of kernel `kind` ("pallas_tpu" / "pallas_gpu") compiled for the target device (see module doc)."""
    if kind == "pallas_tpu":
        from jax.experimental.pallas import tpu as pltpu

        try:
            info = pltpu.get_tpu_info()
        except ValueError as e:
            raise TileError(f"cannot tile for TPU device kind {target_device_kind()!r}: {e}") from None
        return tpu_tiles(num_tokens, num_slots, head_dim, dtype, generation=info.generation,
                         mxu=info.mxu_column_size)
    return gpu_tiles(num_tokens, head_dim, dtype, shared_memory=gpu_shared_memory(target_device_kind()))

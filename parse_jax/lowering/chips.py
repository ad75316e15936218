"""The chips programs are lowered and planned for: platform, the device kind jax reports, memory per chip.

HBM sizes are per chip as a program sees it (one jax device): TPU v4 and v5p run both TensorCores of a chip as one
device (megacore). The TPU figures are those of `jax.experimental.pallas.tpu.get_tpu_info`; the GPU figures are the
totals `nvidia-smi` reports (a JAX process on a GPU gets a fraction of it: on a real device the plan reads the
allocator's limit instead, `memory.device_capacity`).
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from parse_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str        # "tpu" or "cuda" (jax.export's platform names)
    device_kind: str     # what `jax.devices()[0].device_kind` says on that chip
    num_cores: int       # TensorCores per jax device (TPU)
    hbm_bytes: int

    @property
    def abstract_device(self) -> AbstractDevice:
        return AbstractDevice(device_kind=self.device_kind, num_cores=self.num_cores, platform=self.platform)


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v4", "tpu", "TPU v4", 2, 34_400_000_000),
    Chip("v5e", "tpu", "TPU v5 lite", 1, 17_200_000_000),
    Chip("v5p", "tpu", "TPU v5", 2, 103_000_000_000),
    Chip("v6e", "tpu", "TPU v6 lite", 1, 34_400_000_000),
    Chip("h100", "cuda", "NVIDIA H100 80GB HBM3", 1, 81_559 * 2**20),
    Chip("h200", "cuda", "NVIDIA H200", 1, 143_771 * 2**20),
)}
DEFAULT_CHIP = {"tpu": "v5e", "cuda": "h100"}
PLATFORMS = ("tpu", "cuda")


def chip(name: str | None, platform: str | None = None) -> Chip:
    """The chip called `name` (case-insensitive; default: the platform's default chip). A chip of another platform
    than `platform` is refused."""
    if platform is not None and platform not in PLATFORMS:
        raise ConfigError(f"platform {platform!r} is not one programs are lowered for; available: "
                          f"{', '.join(PLATFORMS)}")
    if name is None:
        name = DEFAULT_CHIP[platform or "tpu"]
    key = str(name).lower()
    if key not in CHIPS:
        raise ConfigError(f"unknown chip {name!r}; available: {', '.join(CHIPS)}")
    found = CHIPS[key]
    if platform is not None and found.platform != platform:
        raise ConfigError(f"chip {found.name} is a {found.platform} chip, not a {platform} one")
    return found


def chip_of_device_kind(device_kind: str) -> Chip | None:
    """The table's chip for a real device's kind (None when the table has none)."""
    for c in CHIPS.values():
        if device_kind == c.device_kind or device_kind.startswith(c.device_kind):
            return c
    return None


def abstract_mesh(target: Chip, sizes: dict[str, int] | None = None) -> AbstractMesh:
    """A (data, model) mesh of `target` chips that exist nowhere: what programs are traced and lowered under."""
    sizes = sizes or {"data": 1, "model": 1}
    names = ("data", "model")
    return AbstractMesh(tuple(int(sizes.get(n, 1)) for n in names), names, axis_types=(AxisType.Auto,) * 2,
                        abstract_device=target.abstract_device)

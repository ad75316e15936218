"""The multi-device / multi-host flags of a command, apart from `parse_jax.distributed` so that a CLI can build its
parser without importing jax (`parse-jax --help` stays fast)."""

from __future__ import annotations

import argparse

COORDINATOR_TIMEOUT_S = 300  # jax.distributed.initialize's own default


def add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The multi-device / multi-host flags of a command."""
    g = parser.add_argument_group("devices and hosts")
    g.add_argument("--mesh", default=None,
                   help="device mesh, e.g. data=2,model=4 or a YAML file with `mesh: {data: 2, model: 4}` "
                        "(default: no mesh, one device)")
    g.add_argument("--coordinator", default=None,
                   help="multi-host: address host:port of process 0 (explicit jax.distributed.initialize)")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    g.add_argument("--coordinator-timeout", type=int, default=COORDINATOR_TIMEOUT_S, metavar="SECONDS",
                   help="multi-host: how long to wait for every process to join at --coordinator before giving up "
                        "with an error")
    g.add_argument("--per-host", action="store_true",
                   help="multi-host: each process serves its own share of the requests on a mesh of its local "
                        "devices (--mesh counts one host's devices); process 0 gathers and writes the results")
    g.add_argument("--distributed", action="store_true",
                   help="multi-host: let jax.distributed.initialize read the cluster's environment "
                        "(TPU pod slice, SLURM, Open MPI); also on when PARSE_JAX_DISTRIBUTED=1")
    return parser

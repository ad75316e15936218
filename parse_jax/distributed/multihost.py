"""The multi-host entry for a CLI: `jax.distributed.initialize` from explicit flags or the cluster's environment,
per-host input feeding (`process_slice`) and gathering results (`gather_token_lists`), one writer.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from parse_jax.distributed.args import COORDINATOR_TIMEOUT_S
from parse_jax.distributed.mesh import make_mesh
from parse_jax.errors import ConfigError
from parse_jax.utils.progress import phase

T = TypeVar("T")



# Set by a launcher (SLURM, Open MPI, a TPU pod) when several processes form one job.
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")



def wants_auto_distributed(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for multi-process JAX with no explicit flags: PARSE_JAX_DISTRIBUTED=1, or a
    launcher that started more than one task (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE), or a multi-host TPU slice
    (TPU_WORKER_HOSTNAMES lists more than one worker)."""
    env = os.environ if env is None else env
    if env.get("PARSE_JAX_DISTRIBUTED", "") not in ("", "0"):
        return True
    if any(env.get(k, "1").isdigit() and int(env.get(k, "1")) > 1 for k in _CLUSTER_ENV):
        return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1



def join_coordinator(args: argparse.Namespace) -> None:
    """`jax.distributed.initialize` with the explicit flags, saying what it waits for. If the other processes have
    not joined within --coordinator-timeout seconds, one line on stderr and exit status 2 (jax itself would abort
    the process with a C++ stack a little later)."""
    timeout = int(getattr(args, "coordinator_timeout", None) or COORDINATOR_TIMEOUT_S)
    others = args.num_processes - 1
    what = (f"{others} other process(es) of {args.num_processes} at --coordinator {args.coordinator}"
            if args.process_id == 0 else
            f"process 0 (the coordinator) at {args.coordinator} and the other process(es) of {args.num_processes}")
    phase(f"process {args.process_id}: waiting up to {timeout} s for {what}")

    def give_up() -> None:
        print(f"parse-jax {getattr(args, 'command', '')}: error: no multi-host start after {timeout} s: waited "
              f"for {what} (start every process with the same --coordinator and --num-processes, or raise "
              "--coordinator-timeout)".replace("parse-jax : ", "parse-jax: "), file=sys.stderr, flush=True)
        os._exit(2)

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:  # jax's own deadline comes later, so that the line above is what a person sees
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=timeout + 60)
    finally:
        watchdog.cancel()


def initialize_from_args(args: argparse.Namespace) -> Mesh | None:
    """Start multi-host JAX if asked (flags, or the cluster's environment), then build the mesh of `--mesh` over
    every process's devices (one program spans them all), or with `--per-host` over this process's own devices.
    Call before anything touches a device."""
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in explicit):
        if any(x is None for x in explicit):
            raise ConfigError("--coordinator, --num-processes and --process-id go together")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process-id {args.process_id} must lie in [0, {args.num_processes})")
        if not jax.distributed.is_initialized():
            join_coordinator(args)
    elif (getattr(args, "distributed", False) or wants_auto_distributed()) and not jax.distributed.is_initialized():
        jax.distributed.initialize()
    if args.mesh is None:  # an empty --mesh '' is refused by parse_mesh_spec, never taken for no mesh
        return None
    return make_mesh(args.mesh, jax.local_devices() if getattr(args, "per_host", False) else None)



def is_writer() -> bool:
    """Only process 0 writes results, logs and checkpoints' metadata: the others would write the same."""
    return jax.process_index() == 0



def process_bounds(n: int, process_index: int | None = None, process_count: int | None = None) -> tuple[int, int]:
    """[start, end) of this process's contiguous share of `n` items (the first `n % count` get one more)."""
    i = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    per, extra = divmod(n, count)
    start = i * per + min(i, extra)
    return start, start + per + (i < extra)



def process_slice(items: Sequence[T], process_index: int | None = None,
                  process_count: int | None = None) -> list[T]:
    """Per-host input feeding: this process's contiguous share of the requests."""
    start, end = process_bounds(len(items), process_index, process_count)
    return list(items[start:end])



def gather_token_lists(local: Sequence[Sequence[int]], total: int) -> list[list[int]]:
    """Every process's `process_slice` results, in request order, on every process (so the writer can write
    them all). `total` is the number of requests before slicing. One process: `local` itself."""
    if jax.process_count() == 1:
        return [list(t) for t in local]
    from jax.experimental import multihost_utils

    per = -(-total // jax.process_count())
    width = int(multihost_utils.process_allgather(np.int32(max([len(t) for t in local], default=0))).max())
    buf = np.full((per, max(width, 1)), -1, np.int32)
    lens = np.full((per,), -1, np.int32)  # -1: no request in this row
    for i, t in enumerate(local):
        buf[i, : len(t)] = t
        lens[i] = len(t)
    all_bufs = np.asarray(multihost_utils.process_allgather(buf))
    all_lens = np.asarray(multihost_utils.process_allgather(lens))
    return [all_bufs[p, i, : all_lens[p, i]].tolist()
            for p in range(all_bufs.shape[0]) for i in range(per) if all_lens[p, i] >= 0]

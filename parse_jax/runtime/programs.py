"""Program utilities shared by every jitted program: padding buckets, the registry that counts compilations, the
transfer of results to the host, a decoder as a function, row selection.

Shapes are padded to buckets (batch, prompt length, new tokens, blocks) so a long run compiles a bounded number of
programs; `compiled_programs()` says how many.
"""

from __future__ import annotations

import jax
import numpy as np

from parse_jax.models.decoder import Decoder


def bucket(n: int, minimum: int = 8) -> int:
    """Next power of two >= max(n, minimum): the padding buckets of every static shape."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def length_bucket(n: int, minimum: int = 8) -> int:
    """Next of 2^k and 3 * 2^(k-1) >= max(n, minimum): the buckets of sequence lengths (blocks, caches). Two
    sizes per octave bound padding to a third of a pass instead of half, at twice the programs of `bucket`
    (on CPU a 42-token verification block padded to 64 cost 50% more than one padded to 48)."""
    n = max(int(n), minimum)
    power = bucket(n, 1)
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


FETCHES = [0]  # results moved to the host by `fetch` in this process (GenerateResult.stats["host_transfers"])


def fetch(tree):
    """A program's results on the host, as numpy arrays: the one explicit device-to-host transfer of a generation
    (counted; nothing else in a generation reads a device array on the host)."""
    FETCHES[0] += 1
    leaves, treedef = jax.tree.flatten(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in jax.device_get(leaves)])  # one batched copy
    return jax.tree.unflatten(treedef, [to_host(x) for x in leaves])


def to_host(x) -> np.ndarray:
    """A program's output as a numpy array on this host, gathered from every process when it is sharded across
    hosts (a multi-host mesh whose `data` axis spans processes); plain `np.asarray` otherwise."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)


_PROGRAMS: list = []


def register_program(program):
    """Record a jitted program so that `compiled_programs` counts its compilations."""
    _PROGRAMS.append(program)
    return program


def forward_fn(module: Decoder, params, return_hidden: bool = False):
    """`(tokens, positions, cache, limit, group) -> (logits, cache)` of `module` with `params` (inside a jit);
    with `return_hidden`, `(logits, cache, hiddens)` (see `Decoder`)."""

    def forward(tokens, positions, cache, limit, group):
        logits, cache, hiddens = module.apply({"params": params}, tokens, positions, cache, limit, group,
                                              return_hidden)
        return (logits, cache, hiddens) if return_hidden else (logits, cache)

    return forward


def take_rows(tree, rows: jax.Array):
    """Rows `rows` of every array in `tree` (a cache, logits, ...): a smaller batch of the requests still running."""
    return jax.tree.map(lambda x: x[rows], tree)


take_rows = register_program(jax.jit(take_rows))


def compiled_programs() -> int:
    """Executables this process has compiled for generation, verification and speculation: every jitted program
    counts once per input-shape bucket it has run with (padding buckets keep this bounded)."""
    return sum(p._cache_size() for p in _PROGRAMS)


_SETUP_EVENTS = [0]
_SETUP_SECONDS = [0.0]


def _count_setup(event: str, duration: float, *args, **kwargs) -> None:
    if event.startswith("/jax/core/compile/"):
        _SETUP_EVENTS[0] += 1
        _SETUP_SECONDS[0] += float(duration)


jax.monitoring.register_event_duration_secs_listener(_count_setup)


def setup_events() -> int:
    """Tracings, lowerings and compilations this process has run, as jax reports them: every jitted function and
    eager operation meeting a new shape, registered or not (what `compiled_programs` cannot see: a helper program
    of a serving loop, an eager slice). A stretch of work in which this does not move ran only ready programs."""
    return _SETUP_EVENTS[0]


def setup_seconds() -> float:
    """Seconds of those tracings, lowerings and compilations (loading from the persistent cache included), as jax
    reports their durations: what a run spent setting programs up, apart from the tokens it wrote."""
    return _SETUP_SECONDS[0]

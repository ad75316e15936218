"""Program utilities shared by every jitted program: padding buckets, the registry that counts compilations, the
transfer of results to the host, a decoder as a function, row selection.

Shapes are padded to buckets (batch, prompt length, new tokens, blocks) so a long run compiles a bounded number of
programs; `compiled_programs()` says how many.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from parse_jax.models.decoder import Decoder
from parse_jax.runtime.executables import COMPILE_EVENT, COMPILE_START_EVENT, LOAD_EVENT, LOAD_SAVED_EVENT, Program


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


def register_program(program) -> Program:
    """Record a jitted program so that `compiled_programs` counts its compilations; it runs from the executable
    cache where one is on (`runtime.executables`)."""
    program = Program(program)
    _PROGRAMS.append(program)
    return program


def committed(state, weights):
    """A served run's first state, made outside any program, committed where its programs' outputs will be: on the
    device of the first committed array of `weights` (every weight the run's programs take), else on its own device
    (left as it is where that weight spans several devices). jit sets a program up again for an argument that comes
    back from a call committed where it went in uncommitted: the first admission of every served run did."""
    ref = next((x for x in jax.tree.leaves(weights) if isinstance(x, jax.Array) and x.committed), None)
    if ref is None:
        ref = next(x for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    devices = ref.devices()
    if len(devices) > 1:
        return state
    return jax.device_put(state, jax.sharding.SingleDeviceSharding(next(iter(devices))))


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


@dataclasses.dataclass(frozen=True)
class SetupSplit:
    """Setup seconds (tracing, lowering, compiling or loading programs), as jax reports them, split by where the
    backend's part went: `compiled` (programs compiled here; what a load's backend duration holds beyond its
    retrieval, the cache key's hashing, counts here too) and `loaded` (programs loaded from the persistent compile
    cache). `timed_loads` / `timed_compiles`: the retrieval seconds of the loads whose compiling jax recorded as at
    least a second, and those compile seconds (jax stores them in whole seconds: + 0.5), what loading costs against
    compiling on this machine. The executable cache (`runtime.executables`) the same way: `stored` (the setup
    seconds, as jax reported them, of the programs it compiled and stored here, of which `stored_compiled` was the
    backend's: a load replaces all of it), and `stored_loads` / `stored_set_up`, its loads' seconds against the
    seconds their executables took to set up where they were stored. A running total of this process; the
    difference of two is what some work paid."""

    events: int = 0
    seconds: float = 0.0
    compiled: float = 0.0
    loaded: float = 0.0
    timed_loads: float = 0.0
    timed_compiles: float = 0.0
    stored: float = 0.0
    stored_compiled: float = 0.0
    stored_loads: float = 0.0
    stored_set_up: float = 0.0

    def __sub__(self, other: SetupSplit) -> SetupSplit:
        return SetupSplit(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def loaded_all(self) -> bool:
        """Every program this setup needed came from the persistent cache (what it compiled is a tenth of it at
        most, the loads' own hashing): its seconds are what loading costs."""
        return self.compiled <= 0.1 * self.seconds

    def warm(self, process: SetupSplit) -> float | None:
        """What this setup would cost a process that loads what this one compiled: its seconds where it loaded
        everything, else each cache's part scaled by what loading cost against setting up over `process`'s timed
        loads (the executable cache's programs: their whole setup; jax's: their compiling), the other cache's ratio
        where one has none; None where neither was timed (nothing to scale by)."""
        if self.loaded_all:
            return self.seconds
        exe = process.stored_loads / process.stored_set_up if process.stored_set_up > 0 else None
        jit = process.timed_loads / process.timed_compiles if process.timed_compiles > 0 else None
        exe, jit = (exe if exe is not None else jit), (jit if jit is not None else exe)
        if exe is None:
            return None
        rest = max(self.compiled - self.stored_compiled, 0.0)  # compiled outside the executable cache
        saved = max(self.stored, 0.0) * (1.0 - min(exe, 1.0)) + rest * (1.0 - min(jit, 1.0))
        return max(self.seconds - saved, 0.0)


_SETUP = [SetupSplit()]
_SAVED_BEFORE = [0.0]  # a load's compile seconds saved (jax reports it before the retrieval's duration)
_STORED_BEFORE = [0.0]  # the same for the executable cache: the setup seconds of the executable just loaded
_COMPILE_MARKS: list[SetupSplit] = []  # the totals where each compile of the executable cache under way began
_BACKEND = "/jax/core/compile/backend_compile_duration"
_LOADED = "/jax/compilation_cache/cache_retrieval_time_sec"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def _count_setup(event: str, duration: float, *args, **kwargs) -> None:
    s, d = _SETUP[0], float(duration)
    if event.startswith("/jax/core/compile/"):
        # a load reports its retrieval first, then the backend's duration around it (compiled: less the retrieval)
        compiled = s.compiled + (d if event == _BACKEND else 0.0)
        _SETUP[0] = dataclasses.replace(s, events=s.events + 1, seconds=s.seconds + d, compiled=compiled)
    elif event == LOAD_EVENT:  # an executable loaded from the executable cache: no tracing, lowering or compiling
        timed = _STORED_BEFORE[0] > 0
        _SETUP[0] = dataclasses.replace(s, events=s.events + 1, seconds=s.seconds + d, loaded=s.loaded + d,
                                        stored_loads=s.stored_loads + (d if timed else 0.0),
                                        stored_set_up=s.stored_set_up + _STORED_BEFORE[0])
        _STORED_BEFORE[0] = 0.0
    elif event == LOAD_SAVED_EVENT:
        _STORED_BEFORE[0] = max(d, 0.0)
    elif event == COMPILE_START_EVENT:
        _COMPILE_MARKS.append(s)
    elif event == COMPILE_EVENT and _COMPILE_MARKS:
        # its tracing, lowering and compiling, as jax reported them (counted already): what a load would replace,
        # where it was stored (d > 0); a compile inside another one is the outer one's
        mark = _COMPILE_MARKS.pop()
        if d > 0 and not _COMPILE_MARKS:
            _SETUP[0] = dataclasses.replace(s, stored=s.stored + s.seconds - mark.seconds,
                                            stored_compiled=s.stored_compiled + s.compiled - mark.compiled)
    elif event == _SAVED:
        _SAVED_BEFORE[0] = d
    elif event == _LOADED:
        recorded = _SAVED_BEFORE[0] + d  # the compile seconds jax stored with the program, whole seconds
        _SAVED_BEFORE[0] = 0.0
        timed = recorded >= 1.0  # a program compiled in under a second is stored as 0 s: no ratio to read
        _SETUP[0] = dataclasses.replace(s, loaded=s.loaded + d, compiled=s.compiled - d,
                                        timed_loads=s.timed_loads + (d if timed else 0.0),
                                        timed_compiles=s.timed_compiles + (recorded + 0.5 if timed else 0.0))


jax.monitoring.register_event_duration_secs_listener(_count_setup)


def setup_events() -> int:
    """Tracings, lowerings and compilations this process has run, as jax reports them: every jitted function and
    eager operation meeting a new shape, registered or not (what `compiled_programs` cannot see: a helper program
    of a serving loop, an eager slice). A stretch of work in which this does not move ran only ready programs."""
    return _SETUP[0].events


def setup_split() -> SetupSplit:
    """This process's setup so far, split by compiled and loaded programs (`SetupSplit`)."""
    return _SETUP[0]


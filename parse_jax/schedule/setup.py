"""What a choice's programs cost to set up in a fresh process (tracing, lowering, compiling or loading them from the
persistent compile cache), remembered on disk beside the profiles, so that a later process can price a choice before
it pays for it.

`schedule="auto"` charges this cost to a one-off job (`ParseEngine.job`): a choice whose setup the job's remaining
rows cannot pay back is not run, nor explored (docs/design.md §7). On a CPU the setup of PARSE's programs is tens of
seconds against a few seconds of generation for a 256-problem eval, so an eval would otherwise lose to the target
on setup alone. Figures are keyed by the mode and the rounds its programs run ("parse-single", also where rounds
were set rather than chosen; "target") and batch bucket, in one JSON file per
(target, draft, head) fingerprint, device and versions. A figure is what one process paid in all for the choice at
that bucket, as jax reports its setup durations (its runs meet new shapes one by one: `SetupLedger`), averaged with
the figure it found (`EMA`; the first is taken as it is); a speculative choice never measured is expected to cost
`UNMEASURED_SECONDS`.

A process that compiles a choice's programs writes them into the persistent compile cache (when one is on), and the
next process loads them instead, for a fraction of the cost (on the 2-core CPU, single-round PARSE at batch 8: about
19 s compiled, 6 s loaded; staged since, docs/design.md §5, under 1 s loaded). So each figure has a warm
twin, what the choice costs with its programs in the cache: measured where a process loaded them all, else estimated
from a process that compiled them (`runtime.programs.SetupSplit.warm`: its setup scaled by what its loads cost
against setting up). Where the cache is on, the warm figure is the one expected (`SetupCosts.expected`); without it,
a figure that once paid for compiling would keep the choice from ever running a short job again, and so from ever
measuring its warm cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from parse_jax.runtime import executables
from parse_jax.schedule.profile import model_fingerprint, profiles_dir
from parse_jax.utils import atomic, compile_cache
from parse_jax.utils.progress import logger

# bump when what a figure means changes (2: a process's first figure is taken as it is, and a job that loaded its
# programs from the executable cache leaves a warm figure; figures of format 1 were averaged with the prior, 11.1 s
# for programs that load in about 1 s, and would keep a short eval from PARSE)
FORMAT = 2
EMA = 0.5  # weight of the newest measurement
# a deliberate prior: what a speculative choice never set up with these models on this device is expected to cost
# to set up, until a process measures it. Its programs hold the draft, the verification and their loops (the embedded
# pair on the 2-core CPU: plain decoding 0.8 s at batch 8; single-round PARSE over a 256-problem eval's shapes about
# 6 s loaded from the compile cache, 19 s compiled, before its round ran staged: under 1 s loaded since; multi-round
# 35-58 s per run compiled); set between, so that a job of a few minutes still explores, while one of seconds does
# not pay for programs it has never measured. The prior of both kinds of figure (paid, warm)
UNMEASURED_SECONDS = 10.0


def setup_key(target, draft=None, head=None) -> dict[str, Any]:
    """Everything a setup figure depends on: the models (configs, param shapes), device and versions (not what a
    profile times: a new profile grid or format leaves setup figures as they are)."""
    key: dict[str, Any] = {"format": FORMAT, "target": model_fingerprint(target)}
    if draft is not None:
        key["draft"] = model_fingerprint(draft)["params"]
    if head is not None:
        key["head"] = [repr(head.config), sorted(str(np.shape(x)) for x in jax.tree_util.tree_leaves(head.params))]
    return json.loads(json.dumps(key))


@dataclasses.dataclass(frozen=True)
class SetupCosts:
    """Seconds of setup per (choice, batch bucket), as measured by earlier runs (this process's included), and the
    file they live in (None: kept in memory only). Replaced, never mutated; `save` writes the file whole."""

    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    path: Path | None = None
    key: Mapping[str, Any] | None = None
    warm: Mapping[str, float] = dataclasses.field(default_factory=dict)  # with the programs in the compile cache
    cache_on: bool = False  # this process loads programs from a persistent cache (jax's, or the executable cache):
    # warm figures apply

    @staticmethod
    def name(choice: str, batch_bucket: int) -> str:
        return f"{choice}@{batch_bucket}"

    def get(self, choice: str, batch_bucket: int) -> float | None:
        return self.seconds.get(self.name(choice, batch_bucket))

    def get_warm(self, choice: str, batch_bucket: int) -> float | None:
        return self.warm.get(self.name(choice, batch_bucket))

    def expected(self, choice: str, batch_bucket: int) -> float | None:
        """The figure this process can expect: the warm one where the compile cache is on and one is on record."""
        warm = self.get_warm(choice, batch_bucket) if self.cache_on else None
        return self.get(choice, batch_bucket) if warm is None else warm

    def with_figure(self, choice: str, batch_bucket: int, seconds: float) -> SetupCosts:
        """These figures with a new measurement of `choice` at `batch_bucket` averaged in."""
        return self.with_total(choice, batch_bucket, seconds, self.get(choice, batch_bucket))

    def with_total(self, choice: str, batch_bucket: int, seconds: float, earlier: float | None) -> SetupCosts:
        """These figures with `seconds`, what one process has paid so far to set `choice` up at `batch_bucket` (its
        runs meet new shapes one by one: admission sizes, prompt buckets), averaged with `earlier`, the figure on
        record before that process paid any."""
        return dataclasses.replace(self, seconds=_averaged(self.seconds, self.name(choice, batch_bucket), seconds,
                                                           earlier))

    def with_warm(self, choice: str, batch_bucket: int, seconds: float, earlier: float | None) -> SetupCosts:
        """`with_total` for the warm figure: what one process's setup would have cost with its programs loaded from
        the compile cache (measured or estimated: `runtime.programs.SetupSplit.warm`)."""
        return dataclasses.replace(self, warm=_averaged(self.warm, self.name(choice, batch_bucket), seconds, earlier))

    def save(self) -> None:
        """Write the figures (a read-only cache folder costs a warning, never the run)."""
        if self.path is None:
            return
        try:
            atomic.write_json(self.path, {"fingerprint": dict(self.key or {}), "seconds": dict(self.seconds),
                                          "warm_seconds": dict(self.warm)})
        except OSError as e:
            logger.warning(f"setup costs not saved to {self.path}: {e}")


def _averaged(figures: Mapping[str, float], name: str, seconds: float, earlier: float | None) -> dict[str, float]:
    out = dict(figures)
    out[name] = float(seconds) if earlier is None else EMA * float(seconds) + (1 - EMA) * earlier
    return out


def _or_prior(figure: float | None, speculative: bool) -> float | None:
    """`figure`, else `UNMEASURED_SECONDS` for a speculative choice (None for plain decoding, the baseline every
    mode's programs share)."""
    return UNMEASURED_SECONDS if figure is None and speculative else figure


def expected_setup(costs: SetupCosts, choice: str, batch_bucket: int, *, speculative: bool) -> float | None:
    """The figure on record (`SetupCosts.expected`), else the prior (`_or_prior`)."""
    return _or_prior(costs.expected(choice, batch_bucket), speculative)


class SetupLedger:
    """One process's setup per (choice, batch bucket) of one model set (one setup file): the figure it found on record
    before it paid any (`expected_setup`), what it has paid (each run that set something up adds what jax reported),
    and the choices that have run a batch setting nothing up (`ready`). A process, not an engine: programs are shared
    by every engine in it (`ledger`). Host-side bookkeeping, mutated in place like `runtime.slots.SlotBook`."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, int], SetupCosts] = {}  # the figures on record before this process paid any
        self.paid: dict[tuple[str, int], float] = {}
        self.paid_cold: dict[tuple[str, int], float] = {}
        self.paid_warm: dict[tuple[str, int], float] = {}
        self.ready: set[tuple[str, int]] = set()

    def left(self, costs: SetupCosts, choice: str, batch_bucket: int, *, speculative: bool) -> float | None:
        """What setting `choice` up at `batch_bucket` is still expected to cost: the figure found (not one its own
        partial payments have averaged into) less what was paid; None once ready, or where nothing is expected.
        A figure found from a slower process leaves more to pay than this one will: the charge can then put a
        half-set-up choice above plain decoding for the rest of a job (the price of never charging twice)."""
        key = (choice, batch_bucket)
        if key in self.ready:
            return None
        # the figure found on record (possibly None), else what is expected now
        figure = expected_setup(self.found.get(key, costs), choice, batch_bucket, speculative=speculative)
        return None if figure is None else max(figure - self.paid.get(key, 0.0), 0.0)

    def pay(self, costs: SetupCosts, choice: str, batch_bucket: int, seconds: float, *,
            warm: float | None = None, compiled: bool = True) -> SetupCosts:
        """`costs` with this process's totals for `choice` at `batch_bucket`, `seconds` more: the figure paid
        (where these seconds compiled programs; `compiled=False`: every program came from the compile cache), and
        its warm twin (`warm`: what these seconds would be with every program loaded; None: no compile cache), each
        averaged with the figure of its kind it found, else taken as it is: a prior is no measurement to average
        with (averaged in, the 10 s prior kept a choice whose programs load in under a second out of short jobs for
        several processes)."""
        key = (choice, batch_bucket)
        found = self.found.setdefault(key, costs)
        self.paid[key] = self.paid.get(key, 0.0) + max(float(seconds), 0.0)
        if compiled:
            self.paid_cold[key] = self.paid_cold.get(key, 0.0) + max(float(seconds), 0.0)
            costs = costs.with_total(choice, batch_bucket, self.paid_cold[key], found.get(choice, batch_bucket))
        if warm is not None:
            self.paid_warm[key] = self.paid_warm.get(key, 0.0) + max(float(warm), 0.0)
            costs = costs.with_warm(choice, batch_bucket, self.paid_warm[key], found.get_warm(choice, batch_bucket))
        return costs


_LEDGERS: dict[str, SetupLedger] = {}


def ledger(costs: SetupCosts) -> SetupLedger:
    """This process's ledger of the model set whose figures `costs` holds (one per setup file)."""
    return _LEDGERS.setdefault(str(costs.path), SetupLedger())


def load_setup_costs(target, draft=None, head=None, folder: str | Path | None = None) -> SetupCosts:
    """The setup figures of this model set on this device (empty when none were measured, or the file is stale or
    unreadable)."""
    key = setup_key(target, draft, head)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = (profiles_dir() if folder is None else Path(folder)) / f"setup-{digest}.json"
    cache_on = compile_cache.active() or executables.folder() is not None
    try:
        stored = json.loads(path.read_text())
        if stored.get("fingerprint") == key:
            seconds = {str(k): float(v) for k, v in stored["seconds"].items() if float(v) >= 0}
            warm = {str(k): float(v) for k, v in stored.get("warm_seconds", {}).items() if float(v) >= 0}
            return SetupCosts(seconds, path, key, warm, cache_on)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a corrupt file is no figure
        logger.warning(f"setup costs {path} ignored: {type(e).__name__}: {e}")
    return SetupCosts({}, path, key, {}, cache_on)

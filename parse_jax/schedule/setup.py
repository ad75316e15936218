"""What a choice's programs cost to set up in a fresh process (tracing, lowering, compiling or loading them from the
persistent compile cache), remembered on disk beside the profiles, so that a later process can price a choice before
it pays for it.

`schedule="auto"` charges this cost to a one-off job (`ParseEngine.job`): a choice whose setup the job's remaining
rows cannot pay back is not run, nor explored (docs/design.md §7). On a CPU the setup of PARSE's programs is tens of
seconds against a few seconds of generation for a 256-problem eval, so an eval would otherwise lose to the target
on setup alone. Figures are keyed by choice name ("parse-single", "target") and batch bucket, in one JSON file per
(target, draft, head) fingerprint, device and versions. A figure is what one process paid in all for the choice at
that bucket (its runs meet new shapes one by one), averaged with earlier processes' (`EMA`); a speculative choice
never measured is expected to cost `UNMEASURED_SECONDS`.
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

from parse_jax.schedule.profile import Grid, fingerprint, profiles_dir
from parse_jax.utils import atomic
from parse_jax.utils.progress import logger

FORMAT = 1
EMA = 0.5  # weight of the newest measurement
# what a speculative choice never set up with these models on this device is expected to cost to set up: its
# programs hold the draft, the verification and their loops (the embedded pair on the 2-core CPU, compile cache warm:
# plain decoding 0.8 s at batch 8, single-round PARSE 29 s over a 256-problem eval's shapes; cold, multi-round 35-58 s
# per run), so a short job never pays a setup it has not measured
UNMEASURED_SECONDS = 10.0


def setup_key(target, draft=None, head=None) -> dict[str, Any]:
    """Everything a setup figure depends on: the models (configs, param shapes), device and versions."""
    key: dict[str, Any] = {"format": FORMAT, "target": fingerprint(target, Grid())}
    if draft is not None:
        key["draft"] = fingerprint(draft, Grid())["params"]
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

    @staticmethod
    def name(choice: str, batch_bucket: int) -> str:
        return f"{choice}@{batch_bucket}"

    def get(self, choice: str, batch_bucket: int) -> float | None:
        return self.seconds.get(self.name(choice, batch_bucket))

    def with_figure(self, choice: str, batch_bucket: int, seconds: float) -> SetupCosts:
        """These figures with a new measurement of `choice` at `batch_bucket` averaged in."""
        return self.with_total(choice, batch_bucket, seconds, self.get(choice, batch_bucket))

    def with_total(self, choice: str, batch_bucket: int, seconds: float, earlier: float | None) -> SetupCosts:
        """These figures with `seconds`, what one process has paid so far to set `choice` up at `batch_bucket` (its
        runs meet new shapes one by one: admission sizes, prompt buckets), averaged with `earlier`, the figure on
        record before that process paid any."""
        out = dict(self.seconds)
        out[self.name(choice, batch_bucket)] = (float(seconds) if earlier is None
                                                else EMA * float(seconds) + (1 - EMA) * earlier)
        return dataclasses.replace(self, seconds=out)

    def save(self) -> None:
        """Write the figures (a read-only cache folder costs a warning, never the run)."""
        if self.path is None:
            return
        try:
            atomic.write_json(self.path, {"fingerprint": dict(self.key or {}), "seconds": dict(self.seconds)})
        except OSError as e:
            logger.warning(f"setup costs not saved to {self.path}: {e}")


def load_setup_costs(target, draft=None, head=None, folder: str | Path | None = None) -> SetupCosts:
    """The setup figures of this model set on this device (empty when none were measured, or the file is stale or
    unreadable)."""
    key = setup_key(target, draft, head)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = (profiles_dir() if folder is None else Path(folder)) / f"setup-{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("fingerprint") == key:
            seconds = {str(k): float(v) for k, v in stored["seconds"].items() if float(v) >= 0}
            return SetupCosts(seconds, path, key)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a corrupt file is no figure
        logger.warning(f"setup costs {path} ignored: {type(e).__name__}: {e}")
    return SetupCosts({}, path, key)

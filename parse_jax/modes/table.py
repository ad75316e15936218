"""The mode table: one frozen `ModeSpec` per generation mode, what the engine, bench, sweep, eval and the CLI read
about a mode (its runner, what it needs, how many positions it writes, its bench names) instead of testing names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from parse_jax.modes import eagle3, parse, parse_eagle3_slots, sd, sequential, target
from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request

Positions = Callable[[ModeContext, int], int]
Serve = Callable[[ModeContext, Request, int], "GenerateResult | None"]


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """A generation mode. `target_positions(ctx, max_new)` / `draft_positions(ctx, max_new)`: the positions a request
    needs in the target / the draft past its prompt (what the mode's passes write beyond the last token they may
    emit; None: the mode runs no draft). `multi_label`: the mode honours `ParseConfig.rounds`, and bench names its
    multi-round run so (its plain name runs single round); None: it ignores `rounds`. `serve(ctx, request, max_batch)`:
    the mode by continuous batching through `max_batch` slots (None, or a None result: in fixed batches).
    `separate_prefix_passes`: the mode verifies each prefix in a target pass of its own (what a prefix costs).
    `single_round_ends_plainly`: its single-round run decodes the rest plainly after the first rejected step, where
    its multi-round run drafts again; at one row nothing waits for a row's rounds, so the engine's `rounds="auto"`
    runs multi-round there (docs/design.md §7). `serves_ahead`: its served single-round run verifies ahead of the
    free slots (`modes/verified_slots`: an admission verifies a slot bucket of prompts, rows that continue wait in
    a park), so its caches hold more rows than the slots (`lowering/memory.cache_rows`). `judged`: its target judges
    step prefixes, with the config's verification suffix and judge words."""

    name: str
    runner: Callable[[ModeContext, Request], GenerateResult]
    needs_draft: bool
    needs_head: bool
    target_positions: Positions
    draft_positions: Positions | None = None
    multi_label: str | None = None
    serve: Serve | None = None
    separate_prefix_passes: bool = False
    single_round_ends_plainly: bool = False
    serves_ahead: bool = False
    judged: bool = False

    @property
    def honours_rounds(self) -> bool:
        return self.multi_label is not None

    @property
    def bench_labels(self) -> tuple[str, ...]:
        """The names bench, sweep and eval run this mode under."""
        return (self.name, *((self.multi_label,) if self.multi_label else ()))


def budget_only(ctx: ModeContext, n: int) -> int:
    """The target alone writes its budget and nothing past it."""
    return n


def sd_positions(ctx: ModeContext, n: int) -> int:
    """A speculation round writes gamma proposals and the bonus past the last emitted token (both models)."""
    return n + ctx.config.speculation.gamma + 1


def eagle3_positions(ctx: ModeContext, n: int) -> int:
    """An EAGLE-3 round writes the chain, the tree leaves and the bonus past the last emitted token."""
    return n + ctx.config.eagle3.gamma + ctx.config.eagle3.tree + 1


def verify_positions(ctx: ModeContext, n: int) -> int:
    """A verification block ends with a suffix copy after the longest prefix."""
    return n + len(ctx.suffix_ids) + 1


def verify_eagle3_positions(ctx: ModeContext, n: int) -> int:
    """A verification block, then an EAGLE-3 continuation's rounds (past the last token, in either round kind)."""
    return n + len(ctx.suffix_ids) + ctx.config.eagle3.gamma + ctx.config.eagle3.tree + 1


def draft_answer_positions(ctx: ModeContext, n: int) -> int:
    """The draft writes one answer of at most max_draft_tokens."""
    return min(n, ctx.config.max_draft_tokens)


def parse_draft_positions(ctx: ModeContext, n: int) -> int:
    """Multi round: the draft follows the whole output (and reads one token past it); single round: one answer."""
    return n + 1 if ctx.config.rounds == "multi" else draft_answer_positions(ctx, n)


MODE_TABLE: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("target", target.run, needs_draft=False, needs_head=False, target_positions=budget_only,
             serve=target.serve),
    ModeSpec("sd", sd.run, needs_draft=True, needs_head=False, target_positions=sd_positions,
             draft_positions=sd_positions, serve=sd.serve),
    ModeSpec("sequential", sequential.run, needs_draft=True, needs_head=False, target_positions=verify_positions,
             draft_positions=draft_answer_positions, serve=sequential.serve, separate_prefix_passes=True,
             serves_ahead=True, judged=True),
    ModeSpec("parse", parse.run, needs_draft=True, needs_head=False, target_positions=verify_positions,
             draft_positions=parse_draft_positions, multi_label="parse-multi", serve=parse.serve,
             single_round_ends_plainly=True, serves_ahead=True, judged=True),
    ModeSpec("eagle3", eagle3.run, needs_draft=False, needs_head=True, target_positions=eagle3_positions,
             serve=eagle3.serve),
    ModeSpec("parse+eagle3", parse.run_eagle3, needs_draft=True, needs_head=True,
             target_positions=verify_eagle3_positions, draft_positions=parse_draft_positions,
             multi_label="parse+eagle3-multi", serve=parse_eagle3_slots.serve, serves_ahead=True, judged=True),
)}

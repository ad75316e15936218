"""Mode `eagle3`: the target with EAGLE-3 drafting, lossless (`parse_jax.speculation.eagle3`)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.eagle3 import eagle3_speculate
from parse_jax.speculation.eagle3.serve import serve_eagle3


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    return eagle3_speculate(ctx.target, ctx.head, req, ctx.config.eagle3)


def serve(ctx: ModeContext, req: Request, max_batch: int, *, budgets: list[int] | None = None) -> GenerateResult | None:
    """EAGLE-3 drafting by continuous batching through `max_batch` slots (None on a sharded target: its slot caches
    are not laid out over the mesh, so it runs fixed batches)."""
    if ctx.target.mesh is not None:
        return None
    return serve_eagle3(ctx.target, ctx.head, req, ctx.config.eagle3, max_batch=max_batch, budgets=budgets)

"""Mode `sd`: lossless token-level speculative decoding with the draft model (`parse_jax.speculation.draft_model`)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.draft_model import serve_speculation, speculate


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    return speculate(ctx.target, ctx.draft, req, gamma=ctx.config.speculation.gamma)


def serve(ctx: ModeContext, req: Request, max_batch: int) -> GenerateResult | None:
    """Speculative decoding by continuous batching through `max_batch` slots (None on a sharded target: its slot
    caches are not laid out over the mesh, so it runs fixed batches)."""
    if ctx.target.mesh is not None:
        return None
    return serve_speculation(ctx.target, ctx.draft, req, gamma=ctx.config.speculation.gamma, max_batch=max_batch)

"""Mode `target`: the target alone (the baseline every speed-up is measured against)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.decode import run_request
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.runtime.slots import serve_request


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    return run_request(ctx.target, req)


def serve(ctx: ModeContext, req: Request, max_batch: int) -> GenerateResult | None:
    """The target alone by continuous batching through `max_batch` slots (None on a sharded target: its slot cache
    is not laid out over the mesh, so it runs fixed batches)."""
    if ctx.target.mesh is not None:
        return None
    return serve_request(ctx.target, req, max_batch=max_batch)

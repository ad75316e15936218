"""Mode `target`: the target alone (the baseline every speed-up is measured against)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.decode import generate
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.runtime.slots import serve_request


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    s = req.sampling
    return generate(ctx.target, req.ids, max_new_tokens=req.max_new, temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, seed=s.seed, eos_ids=req.eos.tolist())


def serve(ctx: ModeContext, req: Request, max_batch: int) -> GenerateResult | None:
    """The target alone by continuous batching through `max_batch` slots (None on a sharded target: its slot cache
    is not laid out over the mesh, so it runs fixed batches)."""
    if ctx.target.mesh is not None:
        return None
    return serve_request(ctx.target, req, max_batch=max_batch)

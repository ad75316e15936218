"""Mode `target`: the target alone (the baseline every speed-up is measured against)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.decode import generate
from parse_jax.runtime.requests import GenerateResult, Request


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    s = req.sampling
    return generate(ctx.target, req.ids, max_new_tokens=req.max_new, temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, seed=s.seed, eos_ids=req.eos.tolist())

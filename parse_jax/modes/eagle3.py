"""Mode `eagle3`: the target with EAGLE-3 drafting, lossless (`parse_jax.speculation.eagle3`)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.eagle3 import eagle3_speculate


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    return eagle3_speculate(ctx.target, ctx.head, req, gamma=ctx.config.eagle3.gamma, tree=ctx.config.eagle3.tree)

"""Mode `eagle3`: the target with EAGLE-3 drafting, lossless (`parse_jax.speculation.eagle3`)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.eagle3 import eagle3_speculate


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    e = ctx.config.eagle3
    return eagle3_speculate(ctx.target, ctx.head, req, gamma=e.gamma, tree=e.tree, tree_top_k=e.tree_top_k)

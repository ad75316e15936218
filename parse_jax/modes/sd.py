"""Mode `sd`: lossless token-level speculative decoding with the draft model (`parse_jax.speculation.draft_model`)."""

from __future__ import annotations

from parse_jax.modes.context import ModeContext
from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.draft_model import speculate


def run(ctx: ModeContext, req: Request) -> GenerateResult:
    return speculate(ctx.target, ctx.draft, req, gamma=ctx.config.speculation.gamma)

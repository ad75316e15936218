"""Mode `sd`: lossless token-level speculative decoding with the draft model (`parse_jax.speculation.draft_model`)."""

from __future__ import annotations

from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.draft_model import speculative_generate


def run(eng, req: Request) -> GenerateResult:
    s = req.sampling
    return speculative_generate(eng.target, eng.draft, req.ids, gamma=eng.config.speculation.gamma,
                                max_new_tokens=req.max_new, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=s.seed, eos_ids=req.eos.tolist())

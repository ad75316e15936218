"""Mode `eagle3`: the target with EAGLE-3 drafting, lossless (`parse_jax.speculation.eagle3`)."""

from __future__ import annotations

from parse_jax.runtime.requests import GenerateResult, Request
from parse_jax.speculation.eagle3 import eagle3_generate


def run(eng, req: Request) -> GenerateResult:
    s = req.sampling
    return eagle3_generate(eng.target, eng.eagle3, req.ids, gamma=eng.config.eagle3.gamma,
                           max_new_tokens=req.max_new, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                           seed=s.seed, eos_ids=req.eos.tolist(), tree=eng.config.eagle3.tree)

"""Token-level speculative decoding is lossless: greedy identity, and the target's distribution when sampling."""


import jax
import numpy as np
import pytest

from parse_jax.errors import InputError
from parse_jax.models.model import Model
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import setup_events
from parse_jax.speculation.draft_model import speculative_generate
from tests.random_models import random_model


def _noisy_copy(model, seed, scale):
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, scale, x.shape).astype(np.float32), model.params)
    return Model(model.config, params)


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_is_token_identical_to_the_target(gamma):
    target = random_model("llama3", 30)
    draft = _noisy_copy(target, 31, 0.05)
    rng = np.random.default_rng(gamma)
    prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (4, 11, 7)]
    expect = generate(target, prompts, max_new_tokens=20).tokens
    res = speculative_generate(target, draft, prompts, gamma=gamma, max_new_tokens=20)
    assert res.tokens == expect
    s = res.stats
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]  # a partly wrong draft: both paths exercised
    assert s["target_passes"] < 1 + 3 * 20


def test_greedy_with_eos_and_a_perfect_draft():
    target = random_model("qwen2", 32)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate(target, prompts, max_new_tokens=16).tokens
    eos = free[1][6]
    expect = generate(target, prompts, max_new_tokens=16, eos_ids=[eos]).tokens
    res = speculative_generate(target, target, prompts, gamma=4, max_new_tokens=16, eos_ids=[eos])
    assert res.tokens == expect
    assert res.stats["acceptance_rate"] == 1.0


def _exact_marginals(target, prompt, temperature, steps):
    """The target's marginal distribution of each of the first `steps` sampled tokens, by enumeration."""
    v = target.config.vocab_size
    joint = {(): 1.0}
    out = []
    for _ in range(steps):
        seqs = list(joint)
        ids = np.array([prompt + list(s) for s in seqs])
        probs = np.asarray(jax.nn.softmax(target.logits(ids)[:, -1] / temperature, axis=-1))
        nxt = {}
        for s, pr in zip(seqs, probs):
            for t in range(v):
                nxt[s + (t,)] = joint[s] * pr[t]
        joint = nxt
        marg = np.zeros(v)
        for s, pr in joint.items():
            marg[s[-1]] += pr
        out.append(marg)
    return out


def test_sampling_matches_the_targets_distribution():
    target = random_model("qwen3", 33, vocab_size=6)
    draft = random_model("qwen3", 34, vocab_size=6)
    prompt = [1, 4, 2]
    n, temperature = 3000, 1.0
    res = speculative_generate(target, draft, [prompt] * n, gamma=2, max_new_tokens=3, temperature=temperature,
                               seed=5, eos_ids=[])
    samples = np.array(res.tokens)
    assert samples.shape == (n, 3)
    exact = _exact_marginals(target, prompt, temperature, 3)
    for step in (1, 2):  # tokens drawn through the speculative rounds (step 0 is the prefill's)
        freq = np.bincount(samples[:, step], minlength=6)
        chi2 = np.sum((freq - n * exact[step]) ** 2 / (n * exact[step]))
        assert chi2 < 20.5, (step, freq / n, exact[step])  # 5 dof, p = 0.001
    pairs = np.bincount(samples[:, 1] * 6 + samples[:, 2], minlength=36)
    assert (pairs > 0).sum() > 10  # really random, not a fixed continuation
    # and the draft's own distribution is far from the target's: the test could tell them apart
    own = speculative_generate(draft, draft, [prompt] * n, gamma=2, max_new_tokens=3, temperature=temperature,
                               seed=6, eos_ids=[])
    freq = np.bincount(np.array(own.tokens)[:, 1], minlength=6)
    assert np.sum((freq - n * exact[1]) ** 2 / (n * exact[1])) > 20.5


def test_mismatched_vocabularies_and_bad_gamma_are_refused():
    a, b = random_model("qwen3", 35), random_model("qwen3", 36, vocab_size=50)
    with pytest.raises(InputError, match="different vocabularies"):
        speculative_generate(a, b, [[1, 2]])
    with pytest.raises(InputError, match="gamma"):
        speculative_generate(a, a, [[1, 2]], gamma=0)
    with pytest.raises(InputError, match="cache holds"):
        speculative_generate(a, a, [[1] * 500], max_new_tokens=10)




def _expected_per_position(target, draft, prompt, gamma, budget):
    """(drafts, accepted per position) greedy speculation must count, simulated on the host: round after round
    the draft's own greedy proposals against the target's greedy continuation."""
    full = generate(target, [prompt], max_new_tokens=budget + gamma + 2, eos_ids=[]).tokens[0]
    num, drafts, per_pos = 1, 0, [0] * gamma
    while num < budget:
        seq, props = prompt + full[:num], []
        for _ in range(gamma):
            props.append(int(np.asarray(draft.logits(np.array([seq + props])))[0, -1].argmax()))
        n = 0
        while n < gamma and props[n] == full[num + n]:
            n += 1
        for i in range(n):
            per_pos[i] += 1
        drafts, num = drafts + 1, num + n + 1
    return drafts, per_pos


def test_the_fields_metrics_are_counted_per_position_and_add_up():
    """num_drafts, num_draft_tokens, num_accepted_tokens and the per-position counts, row by row as a host
    simulation counts them; acceptance length = 1 + accepted / drafts = 1 + the per-position rates summed = 1 +
    the sum of the products of the conditional rates (parse_jax/runtime/metrics.py)."""
    target = random_model("llama3", 40, vocab_size=5)  # a small vocabulary: the draft is often right
    draft = _noisy_copy(target, 41, 0.3)
    rng = np.random.default_rng(42)
    prompts = [rng.integers(0, 5, n).tolist() for n in (6, 3, 9)]
    gamma, budget = 3, 14
    expect = [_expected_per_position(target, draft, p, gamma, budget) for p in prompts]
    res = speculative_generate(target, draft, prompts, gamma=gamma, max_new_tokens=budget, eos_ids=[])
    s = res.stats
    assert s["drafts_per_request"] == [d for d, _ in expect]
    assert s["num_accepted_tokens_per_pos"] == [sum(col) for col in zip(*(p for _, p in expect))]
    assert s["num_drafts"] == sum(d for d, _ in expect) and s["num_draft_tokens"] == gamma * s["num_drafts"]
    assert s["num_accepted_tokens"] == s["accepted_tokens"] == sum(s["num_accepted_tokens_per_pos"]) > 0
    assert 0 < s["num_accepted_tokens_per_pos"][-1] < s["num_accepted_tokens_per_pos"][0] < s["num_drafts"]
    assert s["acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert s["acceptance_length"] == pytest.approx(1 + sum(s["acceptance_rate_per_pos"]))
    cond = s["conditional_acceptance_rate_per_pos"]
    assert s["acceptance_length"] == pytest.approx(1 + sum(np.cumprod(cond)))
    assert all(0 <= c <= 1 for c in cond)
    alone = speculative_generate(target, draft, prompts[:1], gamma=gamma, max_new_tokens=budget, eos_ids=[]).stats
    assert alone["num_drafts"] == alone["target_passes"] - 1  # every pass after the prefill verifies a draft


def test_continuous_batching_equals_each_prompt_alone():
    """Slots refilled as rows finish (mixed prompt lengths, per-prompt budgets, an EOS that ends rows early): each
    prompt's tokens and counters equal the prompt run alone."""
    from parse_jax.runtime.requests import Request, SamplingParams, resolve_eos
    from parse_jax.speculation.draft_model import serve_speculation

    target = random_model("qwen3", 41)
    draft = _noisy_copy(target, 42, 0.05)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, target.config.vocab_size, int(rng.integers(2, 14))).tolist() for _ in range(7)]
    budgets = [int(rng.integers(3, 21)) for _ in prompts]
    free = [generate(target, [p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    eos = int(np.bincount([t for row in free for t in row]).argmax())  # a token the target writes often
    alone = [speculative_generate(target, draft, [p], gamma=3, max_new_tokens=b, eos_ids=[eos])
             for p, b in zip(prompts, budgets)]
    assert any(len(r.tokens[0]) < b for r, b in zip(alone, budgets))  # the EOS ended some rows early
    req = Request(ids=prompts, max_new=max(budgets), sampling=SamplingParams(), eos=resolve_eos(target, [eos]))
    served = serve_speculation(target, draft, req, gamma=3, max_batch=3, budgets=budgets)
    assert served.tokens == [r.tokens[0] for r in alone]
    assert served.stats["accepted_per_request"] == [r.stats["accepted_per_request"][0] for r in alone]
    assert served.stats["drafts_per_request"] == [r.stats["drafts_per_request"][0] for r in alone]
    assert served.stats["slots"] == 3 and served.stats["admissions"] > 1
    # each request's passes (its prefill and verifications), as each alone counts them: what bench reports per token
    assert served.stats["request_passes"] == sum(r.stats["target_passes"] for r in alone)
    before = setup_events()  # a second served call runs ready programs only: nothing traced, lowered or compiled
    assert serve_speculation(target, draft, req, gamma=3, max_batch=3, budgets=budgets).tokens == served.tokens
    assert setup_events() == before

"""Multi-round parse+eagle3: the target writes each round's step with EAGLE-3 from the taps of that round's
verification pass, its head's cache carried from round to round, all in one `while_loop` (and through the slots of
`serve_multi`). Greedy float32: threshold 1 gives the target's tokens, any threshold gives multi-round parse's tokens
(EAGLE-3 is lossless, so only the passes differ), served equals one at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import causal_metadata
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.modes.parse_multi import serve_multi
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import setup_events
from parse_jax.runtime.requests import SamplingParams
from parse_jax.runtime.sampling import Sampler
from parse_jax.speculation.eagle3 import EagleContext, EagleLoop, eagle_loop, head_applies
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model
from tests.speculation.test_eagle3 import random_head

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
V = TOK.vocab_size
TARGET = Model(random_model("qwen3", 80, vocab_size=V).config, random_model("qwen3", 80, vocab_size=V).params, TOK)
DRAFT = Model(random_model("llama3", 81, vocab_size=V).config, random_model("llama3", 81, vocab_size=V).params, TOK)
HEAD = random_head(TARGET, 82)
PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) :"]  # mixed lengths
SETTINGS = dict(rounds="multi", schedule="fixed", segmenter="hybrid", min_segment=2, max_segment=6,
                max_draft_tokens=10, max_prefixes=4, delimiter=")")


def _engine(threshold: float) -> ParseEngine:
    return ParseEngine(TARGET, DRAFT, ParseConfig(**SETTINGS, threshold=threshold), eagle3=HEAD)


@pytest.fixture(scope="module")
def partial() -> float:
    """A threshold at which drafts are accepted part-way on these random models, so rows take several rounds."""
    eng = _engine(0.5)
    drafts = generate(DRAFT, PROMPTS, max_new_tokens=10).tokens
    ids = [eng.target.tokenizer.encode(p) for p in PROMPTS]
    scores = np.concatenate([eng.prefix_scores(c, d, eng.boundaries(d)) for c, d in zip(ids, drafts)])
    return float(np.quantile(scores, 0.4))


def test_the_head_cache_carried_over_equals_one_prefill():
    """`EagleContext.head_cache`: EAGLE-3 started from a head cache that holds the first m positions and a context
    of the rest gives the head state of one prefill over the whole context (same head outputs, same cache
    entries), though every row ends at its first token (it does not finish: the head's pass runs)."""
    rng = np.random.default_rng(3)
    b, n, m, cache_len = 2, 12, 5, 32
    tokens = jnp.asarray(rng.integers(4, V, (b, n)), jnp.int32)
    loop = EagleLoop(config=HEAD.config, gamma=3, num_new=4)
    greedy, args = Sampler(greedy=True), SamplingParams(0.0, 0, 1.0, 0).args(b)
    none = jnp.zeros((b,), jnp.int32)  # no tokens to write: the head's state right after its prefill

    def run(target_params, head_params):
        fns = head_applies(TARGET.config, HEAD.config, "xla", target_params, head_params)
        limit, group = causal_metadata(b, n)
        pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        logits, t_cache, feats = fns.target(tokens, pos, KVCache.init(TARGET.config, b, cache_len), limit, group)

        def start(ctx_tokens, ctx_feats, length, first_logits, head_cache=None):
            ctx = EagleContext(tokens=ctx_tokens, features=ctx_feats, length=jnp.full((b,), length, jnp.int32),
                               first_logits=first_logits, head_cache=head_cache, finishes=jnp.zeros((b,), bool))
            return eagle_loop(fns, t_cache.commit(length), ctx, loop=loop, max_new=none,
                              eos_ids=jnp.zeros((1,), jnp.int32) - 1, sampler=greedy, args=args)

        whole = start(tokens, feats, n, logits[:, n - 1])
        forced = jax.nn.one_hot(tokens[:, m], V) * 100.0  # the first m positions' "next token" is the real one
        first = start(tokens[:, :m], feats[:, :m], m, forced)
        rest = start(tokens[:, m:], feats[:, m:], n - m, logits[:, n - 1], first.head_cache)
        return whole, rest

    whole, rest = jax.jit(run)(TARGET.params, HEAD.params)
    assert rest.head_cache.lengths.tolist() == [n] * b
    np.testing.assert_allclose(rest.h_last, whole.h_last, atol=1e-5)
    np.testing.assert_allclose(rest.logits_last, whole.logits_last, atol=1e-4)
    for got, want in zip(rest.head_cache.k + rest.head_cache.v, whole.head_cache.k + whole.head_cache.v):
        np.testing.assert_allclose(np.asarray(got)[:, :, :n], np.asarray(want)[:, :, :n], atol=1e-5)


def test_threshold_one_is_the_target_alone_with_and_without_eagle3():
    eng = _engine(1.0)
    for prompts in (PROMPTS[:1], PROMPTS):
        expect = eng.generate(prompts, mode="target", max_new_tokens=20).tokens
        for mode in ("parse", "parse+eagle3"):
            res = eng.generate(prompts, mode=mode, max_new_tokens=20)
            assert res.tokens == expect, (mode, len(prompts))
            assert res.stats["rounds"] > 1
        assert res.stats["eagle3_draft_tokens"] > 0  # the steps were written with EAGLE-3
        e = eng.config.eagle3  # each draft proposes its chain and tree nodes
        assert res.stats["eagle3_num_drafts"] * (e.gamma + e.tree) == res.stats["eagle3_draft_tokens"]


def test_eagle3_steps_give_multi_round_parse_tokens_at_any_threshold(partial):
    """EAGLE-3 only changes how the target writes its steps, not what it writes: at a threshold where drafts are
    accepted part-way, parse+eagle3 and parse take the same rounds, accept the same draft tokens, write the same."""
    eng = _engine(partial)
    for prompts in (PROMPTS[:1], PROMPTS):
        plain = eng.generate(prompts, mode="parse", max_new_tokens=24)
        res = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=24)
        assert res.tokens == plain.tokens and res.stats["rounds"] == plain.stats["rounds"] > 1
        assert res.stats["accepted_per_request"] == plain.stats["accepted_per_request"]
        assert 0 < sum(res.stats["accepted_per_request"]) < sum(len(t) for t in res.tokens)
        single = ParseEngine(TARGET, DRAFT, ParseConfig(**{**SETTINGS, "rounds": "single"}, threshold=partial),
                             eagle3=HEAD)
        assert single.generate(prompts, mode="parse+eagle3", max_new_tokens=24).stats.get("rounds") is None


def test_a_step_that_is_one_last_token_runs_no_eagle3():
    """Threshold 0 accepts each draft whole: a budget one past the draft leaves every row one token, which the
    target's verification pass already gives. The round emits it without EAGLE-3 (no head pass, no proposals),
    and the tokens are multi-round parse's (greedy), alone and in a batch."""
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**SETTINGS, threshold=0.0), eagle3=HEAD)
    budget = SETTINGS["max_draft_tokens"] + 1
    for prompts in (PROMPTS[:1], PROMPTS):
        plain = eng.generate(prompts, mode="parse", max_new_tokens=budget)
        res = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=budget)
        assert res.tokens == plain.tokens and all(len(t) == budget for t in res.tokens)
        assert res.stats["rounds"] == 1 and res.stats["eagle3_draft_tokens"] == 0
        # one token more: every row's step runs EAGLE-3 again, and still writes parse's tokens
        more = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=budget + 1)
        assert more.tokens == eng.generate(prompts, mode="parse", max_new_tokens=budget + 1).tokens
        assert more.stats["eagle3_draft_tokens"] > 0


def test_served_parse_eagle3_equals_each_prompt_alone(partial):
    eng = _engine(partial)
    budgets = [20, 8, 14]
    alone = [eng.generate([p], mode="parse+eagle3", max_new_tokens=b) for p, b in zip(PROMPTS, budgets)]
    req = eng.request(PROMPTS, "parse+eagle3", max(budgets), 0.0, 0, 0, 1.0, None)
    res = serve_multi(eng.context, req, 2, budgets=budgets, eagle=True)
    assert res.tokens == [r.tokens[0] for r in alone]
    assert res.stats["accepted_per_request"] == [r.stats["accepted_tokens"] for r in alone]
    assert res.stats["eagle3_draft_tokens"] == sum(r.stats["eagle3_draft_tokens"] for r in alone)
    assert res.stats["eagle3_num_drafts"] == sum(r.stats["eagle3_num_drafts"] for r in alone)
    # and through generate(max_batch=...): the engine serves parse+eagle3 in slots
    got = eng.generate(PROMPTS, mode="parse+eagle3", max_new_tokens=14, max_batch=2)
    assert got.stats["slots"] == 2
    before = setup_events()  # the same call again runs ready programs only: nothing traced, lowered or compiled
    assert eng.generate(PROMPTS, mode="parse+eagle3", max_new_tokens=14, max_batch=2).tokens == got.tokens
    assert setup_events() == before
    assert got.tokens == [eng.generate([p], mode="parse+eagle3", max_new_tokens=14).tokens[0] for p in PROMPTS]


def test_the_trained_head_keeps_its_acceptance_across_rounds():
    """On the embedded pair (its trained head accepts most proposals), multi-round parse+eagle3 accepts EAGLE-3
    proposals at about the single round's rate: a head cache, position or feature carried wrong from round to round
    would show as a collapse of that rate (the tokens, being lossless, would not show it)."""
    import parse_jax as pj

    target, draft = pj.load_pair()
    prompts = [p for p, _ in pj.load_task().problems(6, 9)]
    rates = {}
    for rounds in ("single", "multi"):
        eng = ParseEngine(target, draft, ParseConfig(schedule="fixed", rounds=rounds, threshold=1.0))
        res = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=32)
        rates[rounds] = res.stats["eagle3_accepted_tokens"] / res.stats["eagle3_draft_tokens"]
    assert rates["single"] > 0.5 and rates["multi"] > 0.8 * rates["single"], rates


def test_a_step_that_ends_at_a_delimiter_keeps_the_heads_cache(monkeypatch):
    """A round whose step ends at its first token without ending the answer (the token is a delimiter) still runs
    the head's pass over the block, which the next round reads on: after the first round the head's cache equals
    that of a round whose head pass never skips. Threshold 0 accepts the draft whole, and the delimiter is the token
    the target writes right after it, so the round's step is that one token."""
    import parse_jax as pj
    from parse_jax.modes import parse_multi
    from parse_jax.modes.context import PairSpec
    from parse_jax.runtime.programs import bucket

    target, draft = pj.load_pair()
    prompt = pj.load_task().problems(1, 9)[0][0]
    fixed = dict(schedule="fixed", rounds="multi", threshold=0.0, max_draft_tokens=8)
    tokens = ParseEngine(target, draft, ParseConfig(**fixed)).generate([prompt], mode="parse", max_new_tokens=32)
    eng = ParseEngine(target, draft, ParseConfig(**fixed, delimiter=target.tokenizer.decode([tokens.tokens[0][8]])))
    ctx = eng.context
    req = eng.request([prompt], "parse+eagle3", 32, 0.0, 0, 0, 1.0, None)
    launch = parse_multi.multi_launch(ctx, req, eagle=True)
    eagle = parse_multi.eagle_spec(ctx)
    shape = parse_multi.multi_shape(ctx, bucket(len(req.ids[0])), 32, eagle)

    def first_round_state():  # a fresh jit: each call traces `finishing_rows` as it is then
        first_round, _ = parse_multi._rounds(PairSpec.of(ctx), ctx.round_spec, shape, req.sampling.sampler, eagle)
        weights, prompts, eos_ids, seg_stop, judge, args = launch.args
        run = jax.jit(lambda w, p, e, s, j, a: first_round(parse_multi.RoundInputs(w, e, s, j), p, a))
        return run(weights, prompts, eos_ids, seg_stop, judge, args)

    got = first_round_state()
    monkeypatch.setattr(parse_multi, "finishing_rows", lambda remaining, *_: jnp.zeros(remaining.shape, bool))
    never_skips = first_round_state()
    assert int(got.num_new[0]) == 9 and not bool(got.done[0])  # the draft's 8 tokens and the delimiter; not done
    n = int(got.head_cache.lengths[0])
    assert n == int(got.target_cache.lengths[0]) == int(never_skips.head_cache.lengths[0])
    for a, b in zip(got.head_cache.k + got.head_cache.v, never_skips.head_cache.k + never_skips.head_cache.v):
        np.testing.assert_allclose(np.asarray(a)[:, :, :n], np.asarray(b)[:, :, :n], atol=1e-6)
    assert float(jnp.abs(got.head_cache.k[0][:, :, :n]).sum()) > 0

"""EAGLE-3: head shapes and taps per family, training-time test equals the drafting path, lossless decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parse_jax.errors import ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import causal_metadata
from parse_jax.runtime.decode import generate
from parse_jax.speculation.eagle3 import (
    Eagle3,
    Eagle3Config,
    default_taps,
    eagle3_generate,
    head_applies,
    init_head,
    load_eagle3,
    save_eagle3,
    ttt_logits,
)
from tests.random_models import FAMILIES, random_model


def random_head(target, seed: int = 0, scale: float = 0.05) -> Eagle3:
    cfg = Eagle3Config.for_target(target.config)
    params = init_head(cfg, seed)
    rng = np.random.default_rng(seed + 7)
    params = jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, scale, x.shape).astype(np.float32), params)
    return Eagle3(cfg, params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_head_shapes_and_taps(family):
    target = random_model(family, 1, num_layers=5)
    cfg = Eagle3Config.for_target(target.config)
    d = target.config.hidden_size
    p = init_head(cfg)
    assert cfg.taps == default_taps(5) == (3, 3, 3)
    assert default_taps(3) == (1, 2, 3) and default_taps(4) == (2, 3, 3)  # low <= middle <= high
    assert p["fc"]["kernel"].shape == (3 * d, d)
    attn = p["self_attn"]
    assert attn["q_proj"]["kernel"].shape == (2 * d, target.config.num_heads * target.config.head_dim)
    assert attn["k_proj"]["kernel"].shape == (2 * d, target.config.num_kv_heads * target.config.head_dim)
    assert "embed_tokens" not in p and "lm_head" not in p  # shared with the target, never copied
    assert default_taps(8) == (3, 5, 6) and default_taps(36) == (3, 19, 34) and default_taps(1) == (1, 1, 1)


def _teacher_forced_logits(target, head, tokens, t, steps):
    """The drafting path with ground-truth tokens: head prefill over positions 0..t, then `steps - 1` own steps."""
    cfg = head.config
    target_fwd, head_apply, lm = head_applies(target.config, cfg, "xla", target.params, head.params)
    b, length = tokens.shape
    limit, group = causal_metadata(b, length)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    _, _, feats = target_fwd(tokens, pos, KVCache.init(target.config, b, length), limit, group)
    n = t + 1
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)[:, :n]
    lim, grp = causal_metadata(b, n)
    out, normed, cache = head_apply(shifted, feats[:, :n], True, pos[:, :n] + 1, KVCache.init(cfg.layer, b, 64),
                                    lim, grp)
    cache = cache.commit(n)
    hidden, result = out[:, -1], [lm(normed[:, -1])]
    one_l, one_g = causal_metadata(b, 1)
    for k in range(1, steps):
        out, normed, cache = head_apply(tokens[:, t + 1 + k][:, None], hidden[:, None], False,
                                        jnp.full((b, 1), t + 1 + k, jnp.int32), cache, one_l, one_g)
        cache = cache.commit(1)
        hidden = out[:, 0]
        result.append(lm(normed[:, 0]))
    return result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_time_test_equals_the_drafting_path(family):
    target = random_model(family, 3)
    head = random_head(target, 4, scale=0.2)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (2, 12)), jnp.int32)
    b, length = tokens.shape
    limit, group = causal_metadata(b, length)
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    target_fwd, _, _ = head_applies(target.config, head.config, "xla", target.params, head.params)
    _, _, feats = target_fwd(tokens, pos, KVCache.init(target.config, b, length), limit, group)
    steps = 3
    train = ttt_logits(head.params, head.config, target.params, target.config, tokens, feats, steps)
    for t in (0, 4, 7):
        infer = _teacher_forced_logits(target, head, tokens, t, steps)
        for k in range(steps):
            np.testing.assert_allclose(np.asarray(train[k][:, t]), np.asarray(infer[k]), atol=2e-5, rtol=1e-5)
    # and the steps differ from each other: a test that would catch step k silently reusing step 0
    assert not np.allclose(np.asarray(train[0][:, 4]), np.asarray(train[2][:, 4]), atol=1e-3)


@pytest.mark.parametrize("family,gamma", [("llama3", 1), ("qwen2", 3), ("qwen3", 4)])
def test_greedy_is_token_identical_to_the_target(family, gamma):
    target = random_model(family, 10)
    head = random_head(target, 11)
    rng = np.random.default_rng(gamma)
    prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (5, 12, 3)]
    expect = generate(target, prompts, max_new_tokens=18).tokens
    res = eagle3_generate(target, head, prompts, gamma=gamma, max_new_tokens=18)
    assert res.tokens == expect
    s = res.stats
    assert s["target_passes"] <= 18 and s["draft_tokens"] > 0


def test_greedy_identity_with_eos_and_budgets():
    target = random_model("qwen2", 12)
    head = random_head(target, 13)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = generate(target, prompts, max_new_tokens=16).tokens
    eos = free[1][5]
    expect = generate(target, prompts, max_new_tokens=16, eos_ids=[eos]).tokens
    assert eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=16, eos_ids=[eos]).tokens == expect
    for budget in (1, 2, 7):
        assert (eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=budget).tokens
                == generate(target, prompts, max_new_tokens=budget).tokens)


def test_a_start_whose_every_row_ends_at_its_first_token_skips_the_heads_pass():
    """`eagle_start` fills the head's cache with one pass over the context, unless every row ends at its first token
    (its budget, or EOS: an answer a PARSE verification accepted whole), where nothing would read it; where a row
    ends there without finishing (`EagleContext.finishes`: a multi-round PARSE step end, whose next round reads the
    head's cache on), the pass runs. The first token is the same."""
    from parse_jax.runtime.requests import SamplingParams
    from parse_jax.runtime.sampling import Sampler
    from parse_jax.speculation.eagle3.decode import EagleContext, EagleLoop, eagle_start, first_token

    target = random_model("llama3", 14)
    head = random_head(target, 15)
    b, n = 2, 6
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, target.config.vocab_size, (b, n)), jnp.int32)
    greedy, args = Sampler(greedy=True), SamplingParams(0.0, 0, 1.0, 0).args(b)

    def start(tp, hp, max_new, eos, finishes, head_cache=None):
        fns = head_applies(target.config, head.config, "xla", tp, hp)
        limit, group = causal_metadata(b, n)
        pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
        logits, cache, feats = fns.target(tokens, pos, KVCache.init(target.config, b, 32), limit, group)
        ctx = EagleContext(tokens=tokens, features=feats, length=jnp.full((b,), n, jnp.int32),
                           first_logits=logits[:, n - 1], finishes=finishes, head_cache=head_cache)
        loop = EagleLoop(config=head.config, gamma=3, num_new=4)
        st = eagle_start(fns, cache.commit(n), ctx, loop=loop, max_new=max_new, eos_ids=eos, sampler=greedy,
                         args=args)
        return st, first_token(ctx.first_logits, greedy, args)

    run = jax.jit(start)
    no_eos = jnp.asarray([-1], jnp.int32)
    p = (target.params, head.params)
    every, one = jnp.asarray([True, True]), jnp.asarray([True, False])
    cont, first = run(*p, jnp.asarray([1, 5], jnp.int32), no_eos, every)  # one row goes on: the pass runs
    assert cont.head_cache.lengths.tolist() == [n, n] and cont.tokens[:, 0].tolist() == first.tolist()
    assert float(jnp.abs(cont.logits_last).sum()) > 0
    for max_new, eos in ((jnp.asarray([1, 1], jnp.int32), no_eos), (jnp.asarray([5, 7], jnp.int32), first)):
        done, _ = run(*p, max_new, eos, every)  # every row ends at its first token and finishes: no pass
        assert done.done.tolist() == [True, True] and done.head_cache.lengths.tolist() == [0, 0]
        assert done.tokens[:, 0].tolist() == first.tolist()
        carried, _ = run(*p, max_new, eos, one)  # one row's head cache is read on: the pass runs
        assert carried.head_cache.lengths.tolist() == [n, n]
        np.testing.assert_allclose(carried.logits_last, cont.logits_last, atol=1e-5)
        by_default, _ = run(*p, max_new, eos, None)  # no `finishes`: every row that ends finishes
        assert by_default.head_cache.lengths.tolist() == [0, 0]
    # a head cache the context continues, where every row ends and finishes: handed back as it was
    given = KVCache.init(head.config.layer, b, 32)
    given = given.replace(k=tuple(x + 1.0 for x in given.k)).set_lengths(jnp.asarray([2, 3], jnp.int32))
    kept, _ = run(*p, jnp.asarray([1, 1], jnp.int32), no_eos, every, given)
    assert kept.head_cache.lengths.tolist() == [2, 3]
    np.testing.assert_array_equal(kept.head_cache.k[0], given.k[0])


def test_sampling_follows_the_target_distribution():
    """Rejection sampling against the head's distribution: the joint of the first two sampled tokens matches the
    target's exact joint (chi-square over all 25 outcomes of a 5-token vocabulary)."""
    target = random_model("qwen3", 20, vocab_size=5)
    head = random_head(target, 21, scale=0.3)
    prompt, v, n = [1, 2, 3], 5, 2000
    first = jax.nn.softmax(target.logits([prompt])[0, -1])
    second = jax.nn.softmax(target.logits([prompt + [a] for a in range(v)])[:, -1], axis=-1)
    exact = np.asarray(first)[:, None] * np.asarray(second)  # [a, b]
    res = eagle3_generate(target, head, [prompt] * n, gamma=3, max_new_tokens=2, temperature=1.0, seed=1)
    counts = np.zeros((v, v))
    for a, b in res.tokens:
        counts[a, b] += 1
    chi2 = float((((counts - n * exact) ** 2) / (n * exact)).sum())
    assert chi2 < 51.18, chi2  # chi-square, 24 degrees of freedom, p = 0.001
    assert 0 < res.stats["accepted_tokens"] < res.stats["draft_tokens"]  # both acceptance paths ran


def test_a_head_for_another_target_is_refused(tmp_path):
    target = random_model("llama3", 30)
    head = random_head(target, 31)
    save_eagle3(head, tmp_path / "head")
    assert load_eagle3(tmp_path / "head", target).config == head.config
    other = random_model("llama3", 30, hidden_size=48, head_dim=12)
    with pytest.raises(ConfigError, match="another target.*hidden_size"):
        load_eagle3(tmp_path / "head", other)
    deeper = random_model("llama3", 30, num_layers=4)
    with pytest.raises(ConfigError, match="num_layers"):
        load_eagle3(tmp_path / "head", deeper)
    with pytest.raises(ConfigError, match="vocab_size"):
        eagle3_generate(random_model("llama3", 30, vocab_size=50), head, [[1, 2]], max_new_tokens=2)
    with pytest.raises(InputError, match="gamma"):
        eagle3_generate(target, head, [[1, 2]], gamma=0)


def _engine_pair():
    from parse_jax.models.model import Model
    from parse_jax.models.tokenizer import Tokenizer
    from parse_jax.tasks import TOKENIZER_DIR

    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    t = random_model("qwen3", 40, vocab_size=tok.vocab_size)
    d = random_model("llama3", 41, vocab_size=tok.vocab_size)
    return Model(t.config, t.params, tok), Model(d.config, d.params, tok)


ENGINE_PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]


def test_engine_modes_eagle3_and_parse_eagle3():
    from parse_jax.engine import ParseConfig, ParseEngine

    target, draft = _engine_pair()
    head = random_head(target, 42)
    expect = generate(target, ENGINE_PROMPTS, max_new_tokens=20).tokens
    eng = ParseEngine(target, draft, ParseConfig(max_draft_tokens=12, threshold=1.0, schedule="fixed"), eagle3=head)
    assert eng.generate(ENGINE_PROMPTS, mode="eagle3", max_new_tokens=20).tokens == expect
    res = eng.generate(ENGINE_PROMPTS, mode="parse+eagle3", max_new_tokens=20)
    assert res.tokens == expect  # threshold 1: nothing accepted, the continuation is lossless EAGLE-3
    assert res.stats["accepted_tokens"] == 0 and res.stats["eagle3_draft_tokens"] > 0
    # threshold 0: every draft accepted, then EAGLE-3 continues from the committed boundary with the features of
    # the verification pass; the continuation equals the target's own greedy continuation of that context
    cfg0 = ParseConfig(max_draft_tokens=6, threshold=0.0, schedule="fixed", rounds="single")
    eng0 = ParseEngine(target, draft, cfg0, eagle3=head)
    res0 = eng0.generate(ENGINE_PROMPTS, mode="parse+eagle3", max_new_tokens=20)
    ids = [target.tokenizer.encode(p) for p in ENGINE_PROMPTS]
    bos = target.tokenizer.bos_id
    ids = [([bos] if bos is not None else []) + x for x in ids]
    for i, acc in enumerate(res0.stats["accepted_per_request"]):
        assert acc > 0
        prefix = res0.tokens[i][:acc]
        cont = generate(target, [ids[i] + prefix], max_new_tokens=20 - acc).tokens[0] if acc < 20 else []
        assert res0.tokens[i][acc:] == cont


def test_engine_without_a_head_says_how_to_get_one():
    from parse_jax.engine import ParseEngine

    target, draft = _engine_pair()
    with pytest.raises(ConfigError, match="needs an EAGLE-3 head"):
        ParseEngine(target, draft).generate(ENGINE_PROMPTS, mode="eagle3", max_new_tokens=4)
    other = random_model("qwen3", 1, vocab_size=target.config.vocab_size, hidden_size=64)
    with pytest.raises(ConfigError, match="another target"):
        ParseEngine(target, draft, eagle3=random_head(other, 2))


def test_trees_are_greedy_only():
    target = random_model("qwen2", 60, vocab_size=6)
    with pytest.raises(InputError, match="greedy only"):
        eagle3_generate(target, random_head(target, 61), [[1, 2]], gamma=3, max_new_tokens=4, tree=2, temperature=1.0)
    with pytest.raises(InputError, match="temperature must be a number"):  # checked before it is compared
        eagle3_generate(target, random_head(target, 61), [[1, 2]], gamma=3, max_new_tokens=4, tree=2, temperature="1")
    with pytest.raises(InputError, match="tree_width"):  # the settings' joint check, as an argument error
        eagle3_generate(target, random_head(target, 61), [[1, 2]], gamma=3, max_new_tokens=4, tree=2, tree_top_k=2,
                        tree_width=3)


def _expected_accepted(target, head, prompt, gamma, budget):
    """Draft tokens greedy chain drafting must accept, from the training-time-test logits along the target's own
    greedy continuation: round after round, the head's step-k argmax at the last committed position against the
    target's tokens (what the drafting loop must reproduce; a wrong head position or feature changes it)."""
    from parse_jax.train.forward import train_forward

    full = generate(target, [prompt], max_new_tokens=budget + gamma + 2, eos_ids=[]).tokens[0]
    x = jnp.asarray([prompt + full], jnp.int32)
    _, hiddens = train_forward(target.params, target.config, x)
    feats = jnp.concatenate([hiddens[i] for i in head.config.taps], axis=-1)
    steps = [np.asarray(s[0]).argmax(-1) for s in ttt_logits(head.params, head.config, target.params, target.config,
                                                             x, feats, gamma)]
    last, num, accepted = len(prompt), 1, 0
    while num < budget:
        n = 0
        while n < gamma and steps[n][last - 1] == int(x[0, last + 1 + n]):
            n += 1
        accepted, num, last = accepted + n, num + n + 1, last + n + 1
    return accepted


def test_chain_drafting_accepts_exactly_what_the_head_predicts():
    """Greedy identity holds whatever the head proposes; this checks the drafting itself (head cache, positions,
    features after each verification) by the number of proposals accepted, row by row, with ragged prompts."""
    target = random_model("llama3", 70, vocab_size=3)  # a random head still guesses right often
    head = random_head(target, 71, scale=0.3)
    rng = np.random.default_rng(72)
    prompts = [rng.integers(0, 3, n).tolist() for n in (9, 4, 6)]
    expect = [_expected_accepted(target, head, p, 3, 16) for p in prompts]
    got = [eagle3_generate(target, head, [p], gamma=3, max_new_tokens=16, eos_ids=[]).stats["accepted_tokens"]
           for p in prompts]
    assert got == expect and sum(expect) > 0
    batch = eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=16, eos_ids=[])
    assert batch.stats["accepted_tokens"] == sum(expect)
    s = batch.stats  # the field's metrics: per depth of the chain, adding up (parse_jax/runtime/metrics.py)
    per = s["num_accepted_tokens_per_pos"]
    assert len(per) == 3 and sum(per) == s["num_accepted_tokens"] == sum(expect)
    assert list(per) == sorted(per, reverse=True) and per[0] <= s["num_drafts"]
    assert s["num_draft_tokens"] == 3 * s["num_drafts"] and sum(s["drafts_per_request"]) == s["num_drafts"]
    assert s["acceptance_length"] == pytest.approx(1 + sum(expect) / s["num_drafts"])
    assert s["acceptance_length"] == pytest.approx(1 + sum(np.cumprod(s["conditional_acceptance_rate_per_pos"])))


@pytest.mark.parametrize("tree,width", [(0, 0), (3, 0), (3, 1)])
def test_continuous_batching_equals_each_prompt_alone(tree, width):
    """Slots refilled as rows finish (mixed prompt lengths, per-prompt budgets, an EOS that ends rows early), the
    chain, a tree and a tree one path wide: each prompt's tokens and counters equal the prompt run alone."""
    from parse_jax.runtime.requests import Request, SamplingParams, resolve_eos
    from parse_jax.settings import Eagle3Settings
    from parse_jax.speculation.eagle3.serve import serve_eagle3

    target = random_model("llama3", 14)
    head = random_head(target, 15)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, target.config.vocab_size, int(rng.integers(2, 14))).tolist() for _ in range(6)]
    budgets = [int(rng.integers(3, 19)) for _ in prompts]
    free = [generate(target, [p], max_new_tokens=b).tokens[0] for p, b in zip(prompts, budgets)]
    eos = int(np.bincount([t for row in free for t in row]).argmax())  # a token the target writes often
    alone = [eagle3_generate(target, head, [p], gamma=3, max_new_tokens=b, eos_ids=[eos], tree=tree,
                             tree_width=width)
             for p, b in zip(prompts, budgets)]
    assert any(len(r.tokens[0]) < b for r, b in zip(alone, budgets))  # the EOS ended some rows early
    req = Request(ids=prompts, max_new=max(budgets), sampling=SamplingParams(), eos=resolve_eos(target, [eos]))
    eagle = Eagle3Settings(gamma=3, tree=tree, tree_top_k=4, tree_width=width)
    served = serve_eagle3(target, head, req, eagle, max_batch=2, budgets=budgets)
    assert served.tokens == [r.tokens[0] for r in alone]
    assert served.stats["accepted_per_request"] == [r.stats["accepted_per_request"][0] for r in alone]
    assert served.stats["slots"] == 2 and served.stats["admissions"] > 1
    assert served.stats["request_passes"] == sum(r.stats["target_passes"] for r in alone)  # as each alone counts
    if tree == 0:  # a second served call runs ready programs only: nothing traced, lowered or compiled again
        from parse_jax.runtime.programs import setup_events

        before = setup_events()
        again = serve_eagle3(target, head, req, eagle, max_batch=2, budgets=budgets)
        assert again.tokens == served.tokens and setup_events() == before

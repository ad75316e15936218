"""ParseEngine on random models with the embedded task's tokenizer: the contracts of docs/design.md §2 and §4."""

import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.errors import ConfigError, InputError
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.decode import generate
from parse_jax.tasks import TOKENIZER_DIR
from tests.random_models import random_model

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
V = TOK.vocab_size


def _model(seed, family="qwen3"):
    m = random_model(family, seed, vocab_size=V)
    return Model(m.config, m.params, TOK)


TARGET, DRAFT = _model(40), _model(41, "llama3")
PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :"]


def _engine(**kw):
    return ParseEngine(TARGET, DRAFT, ParseConfig(**{"max_draft_tokens": 12, "rounds": "single", "schedule": "fixed",
                                                     **kw}))


def test_prefix_scores_equal_separate_causal_passes():
    eng = _engine()
    rng = np.random.default_rng(0)
    ctx, draft = rng.integers(0, V, 5).tolist(), rng.integers(0, V, 11).tolist()
    bounds = [2, 6, 11]
    scores = eng.prefix_scores(ctx, draft, bounds)
    assert scores.shape == (3,)
    for k, b in enumerate(bounds):
        logits = TARGET.logits(np.array([ctx + draft[:b] + eng.suffix_ids]))[0, -1]
        expect = 1 / (1 + np.exp(-(logits[eng.yes_id] - logits[eng.no_id])))
        assert abs(scores[k] - expect) < 1e-5


@pytest.mark.parametrize("mode", ["parse", "sequential"])
def test_threshold_above_one_is_the_target_alone(mode):
    expect = generate(TARGET, PROMPTS, max_new_tokens=20).tokens
    res = _engine(threshold=1.0).generate(PROMPTS, mode=mode, max_new_tokens=20)
    assert res.tokens == expect
    assert res.stats["accepted_tokens"] == 0


@pytest.mark.parametrize("mode", ["parse", "sequential"])
@pytest.mark.parametrize("threshold", [0.5, 0.6])  # 3 and 5 of 6 rows continue: a batch of 4 (gathered), and of 8
def test_only_rejected_rows_are_continued_and_each_row_matches_its_own_run(mode, threshold):
    """Rows whose whole draft is accepted need no continuation; the others are decoded in a smaller batch (gathered
    from the verified cache). Every row must still equal the same request run alone."""
    prompts = PROMPTS + ["( 2 + 2 ) :", "( 9 - 1 ) * 3 :", "4 * ( 4 + 4 ) :"]
    eng = _engine(threshold=threshold, segmenter="stride", stride=3)
    res = eng.generate(prompts, mode=mode, max_new_tokens=12)
    assert 0 < res.stats["continued_requests"] < len(prompts)  # a mix: some rows done, the others continue
    for p, tokens, accepted in zip(prompts, res.tokens, res.stats["accepted_per_request"]):
        alone = eng.generate([p], mode=mode, max_new_tokens=12)
        assert alone.stats["accepted_per_request"] == [accepted]
        assert alone.tokens[0] == tokens


def test_threshold_zero_accepts_every_draft():
    eng = _engine(threshold=0.0)
    drafts = generate(DRAFT, PROMPTS, max_new_tokens=12, eos_ids=[TOK.eos_id]).tokens
    res = eng.generate(PROMPTS, mode="parse", max_new_tokens=20)
    assert res.stats["accepted_per_request"] == [len(d) for d in drafts]
    for d, out in zip(drafts, res.tokens):
        assert out[: len(d)] == d


@pytest.mark.parametrize("segmenter", ["hybrid", "stride"])
def test_sequential_and_parse_accept_the_same_prefix(segmenter):
    seg = dict(segmenter=segmenter, stride=3, min_segment=2, max_segment=4)
    probe = _engine(**seg)
    drafts = generate(DRAFT, PROMPTS, max_new_tokens=12, eos_ids=[TOK.eos_id]).tokens
    ids = [[TOK.bos_id] + TOK.encode(p) for p in PROMPTS]
    scores = np.concatenate([probe.prefix_scores(c, d, probe.boundaries(d)) for c, d in zip(ids, drafts)])
    partial = 0
    for threshold in np.quantile(scores, [0.2, 0.6]):
        eng = _engine(**seg, threshold=float(threshold))
        par = eng.generate(PROMPTS, mode="parse", max_new_tokens=20)
        seq = eng.generate(PROMPTS, mode="sequential", max_new_tokens=20)
        assert par.stats["accepted_per_request"] == seq.stats["accepted_per_request"]
        assert par.tokens == seq.tokens
        assert par.stats["verify_passes"] == 1 and seq.stats["verify_passes"] > 1
        partial += sum(0 < a < len(d) for a, d in zip(par.stats["accepted_per_request"], drafts))
    assert partial > 0  # some drafts accepted part-way: the comparison is not trivially all-or-nothing


def test_sd_and_target_modes_through_the_engine():
    eng = _engine()
    assert eng.generate(PROMPTS, mode="sd", max_new_tokens=12).tokens == \
        eng.generate(PROMPTS, mode="target", max_new_tokens=12).tokens


def test_bad_configuration_and_requests():
    with pytest.raises(ConfigError, match="prefix of the other"):
        ParseEngine(TARGET, DRAFT, ParseConfig(judge_yes="Correct Correct", judge_no="Correct"))
    with pytest.raises(ConfigError, match="segmenter"):
        ParseConfig(segmenter="sentences")
    with pytest.raises(ConfigError, match="never occur"):  # no token of the task's vocabulary writes a newline
        ParseEngine(TARGET, DRAFT, ParseConfig(delimiter="\n\n"))
    with pytest.raises(ConfigError, match="vocabulary"):
        ParseEngine(TARGET, DRAFT, ParseConfig(judge_yes="Yes"))
    with pytest.raises(InputError, match="unknown mode"):
        _engine().generate(PROMPTS, mode="fast")
    with pytest.raises(ConfigError, match="different vocabulary sizes"):
        ParseEngine(TARGET, random_model("qwen3", 1))
    with pytest.raises(InputError, match="draft is empty"):
        _engine().prefix_scores([1, 2], [], [1])
    with pytest.raises(InputError, match="increasing"):
        _engine().prefix_scores([1, 2], [3, 4, 5], [2, 1])


def test_multi_round_threshold_above_one_is_the_target_alone_and_zero_accepts_drafts():
    expect = generate(TARGET, PROMPTS, max_new_tokens=24).tokens
    eng = _engine(threshold=1.0, rounds="multi", segmenter="stride", stride=3, max_segment=5, min_segment=2)
    res = eng.generate(PROMPTS, mode="parse", max_new_tokens=24)
    assert res.tokens == expect
    assert res.stats["accepted_tokens"] == 0 and res.stats["rounds"] > 1
    eager = _engine(threshold=0.0, rounds="multi", segmenter="stride", stride=3, max_segment=5, min_segment=2)
    res = eager.generate(PROMPTS, mode="parse", max_new_tokens=24)
    assert res.stats["accepted_tokens"] > 0
    assert all(len(t) <= 24 for t in res.tokens)
    first = generate(DRAFT, PROMPTS, max_new_tokens=12, eos_ids=[TOK.eos_id]).tokens
    for d, out in zip(first, res.tokens):
        assert out[: len(d)] == d[:24]


def test_a_long_run_compiles_a_bounded_number_of_programs():
    """After one request per shape bucket, requests of other lengths and batch sizes in the same buckets compile
    nothing new (stats["compiled_programs"] counts real executables), except one continuation program and one row
    gather per continuation batch bucket (1, 2, 4 here) not seen yet: PARSE continues only the rows it rejected."""
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(max_draft_tokens=8, segmenter="stride", stride=3, threshold=0.3,
                                                 schedule="fixed", rounds="single"))
    rng = np.random.default_rng(0)

    def prompts(n, length):
        return [[1, *rng.integers(4, 20, length).tolist()] for _ in range(n)]

    seen = set()
    for mode in ("parse", "sequential", "sd", "target"):
        seen.add((mode, eng.generate(prompts(3, 5), mode=mode, max_new_tokens=10).stats.get("continue_batch")))
    before = eng.generate(prompts(3, 5), mode="parse", max_new_tokens=10).stats["compiled_programs"]
    new_buckets = set()
    for n, length in ((4, 5), (3, 4), (4, 3)):
        for mode in ("parse", "sequential", "sd", "target"):
            stats = eng.generate(prompts(n, length), mode=mode, max_new_tokens=12).stats
            after = stats["compiled_programs"]
            if mode in ("parse", "sequential"):
                assert stats["continue_batch"] in (0, 1, 2, 4)
                assert stats["continue_batch"] >= stats["continued_requests"]
                if (mode, stats["continue_batch"]) not in seen:
                    new_buckets.add((mode, stats["continue_batch"]))
    assert after - before <= 2 * len(new_buckets)

"""The fused PARSE programs (parse_jax/modes/) against the host-orchestrated reference path (tests/parse_reference.py,
numpy layout + one program per phase), token for token in float32 greedy, for every segmenter and policy, single and
multi round; and the contract that one `generate` moves nothing to the host but its results."""

import jax
import numpy as np
import pytest

from parse_jax.engine import ParseConfig, ParseEngine
from parse_jax.models.model import Model
from parse_jax.models.tokenizer import Tokenizer
from parse_jax.runtime.decode import generate
from parse_jax.tasks import TOKENIZER_DIR
from tests.host_reads import host_reads
from tests.parse_reference import ReferenceParse
from tests.random_models import random_model

TOK = Tokenizer.from_folder(TOKENIZER_DIR)
V = TOK.vocab_size
TARGET = Model(random_model("qwen3", 50, vocab_size=V).config, random_model("qwen3", 50, vocab_size=V).params, TOK)
DRAFT = Model(random_model("llama3", 51, vocab_size=V).config, random_model("llama3", 51, vocab_size=V).params, TOK)
PROMPTS = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :", "( 5 - 5 ) + ( 6 * 2 ) :", "( 2 + 2 ) :"]


def _threshold_with_partial_acceptance(eng: ParseEngine) -> float:
    """A threshold at which some drafts are accepted part-way on these random models (the comparison is then not
    trivially all-or-nothing)."""
    drafts = generate(DRAFT, PROMPTS, max_new_tokens=eng.config.max_draft_tokens, eos_ids=[TOK.eos_id]).tokens
    ids = [[TOK.bos_id] + TOK.encode(p) for p in PROMPTS]
    scores = np.concatenate([eng.prefix_scores(c, d, eng.boundaries(d)) for c, d in zip(ids, drafts)])
    return float(np.quantile(scores, 0.4))


CASES = [  # (segmenter, policy, rounds, batch sizes, modes): each segmenter and each policy in both rounds; batch 1
    # (one fused program) and 4 (the split continuation) and sequential each in more than one case
    ("delimiter", "earliest_error", "single", (1, 4), ("parse", "sequential")),
    ("stride", "longest_valid", "single", (4,), ("parse",)),
    ("hybrid", "earliest_error", "single", (1,), ("parse", "sequential")),
    ("hybrid", "longest_valid", "multi", (1, 4), ("parse",)),
    ("stride", "earliest_error", "multi", (4,), ("parse",)),
    ("delimiter", "longest_valid", "multi", (1,), ("parse",)),
]


@pytest.mark.parametrize("segmenter,policy,rounds,batches,modes", CASES)
def test_fused_programs_equal_the_reference_path(segmenter, policy, rounds, batches, modes):
    base = dict(segmenter=segmenter, policy=policy, rounds=rounds, stride=3, min_segment=2, max_segment=5,
                max_draft_tokens=12, max_prefixes=5, delimiter=")")  # K not a power of 2
    threshold = _threshold_with_partial_acceptance(ParseEngine(TARGET, DRAFT, ParseConfig(**base, schedule="fixed")))
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**base, threshold=threshold, schedule="fixed"))
    ref = ReferenceParse(eng)
    for mode in modes:
        for prompts in (PROMPTS[:b] for b in batches):
            got = eng.generate(prompts, mode=mode, max_new_tokens=20)
            expect = ref.generate(prompts, mode=mode, max_new_tokens=20)
            assert got.tokens == expect.tokens, (mode, len(prompts))
            assert got.stats["accepted_tokens"] == expect.stats["accepted_tokens"]
            if rounds == "single":
                assert got.stats["target_passes"] == expect.stats["target_passes"]
                assert got.stats["continued_requests"] == expect.stats["continued_requests"]
            else:  # the reference prefills the prompt in a pass of its own; the fused program verifies it with
                assert got.stats["rounds"] == expect.stats["rounds"]  # the first draft
                assert got.stats["target_passes"] == expect.stats["target_passes"] - 1


@pytest.mark.parametrize("rounds", ["single", "multi"])
def test_one_generate_moves_nothing_to_the_host_but_its_results(rounds):
    """No device value is read on the host during a generation (np.asarray, int(), a Python branch on a device
    value) except by the one explicit `programs.fetch` of the results. On an accelerator the transfer guard would
    raise on such a read; on CPU it cannot see one, so tests/host_reads.py records them."""
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(rounds=rounds, schedule="fixed", max_draft_tokens=12, threshold=0.3,
                                                 segmenter="stride", stride=3, max_segment=5, min_segment=2))
    eng.generate(PROMPTS[:1], mode="parse", max_new_tokens=30)  # compile outside the watch
    with host_reads() as outside, jax.transfer_guard_device_to_host("disallow"):
        res = eng.generate(PROMPTS[:1], mode="parse", max_new_tokens=30)
    assert outside == [] and res.stats["host_transfers"] == 1
    assert res.stats["accepted_tokens"] > 0 and res.stats["new_tokens"] > res.stats["accepted_tokens"]
    if rounds == "multi":
        assert res.stats["rounds"] > 1
        with host_reads() as outside:  # every row in the one program at batch > 1 too
            assert eng.generate(PROMPTS, mode="parse", max_new_tokens=30).stats["host_transfers"] == 1
        assert outside == []


def test_the_host_read_watch_sees_every_kind_of_read():
    """The watch the test above relies on records each way a device value reaches the host, and not the fetch."""
    from parse_jax.runtime.programs import fetch

    reads = [lambda a: np.asarray(a), lambda a: np.array(a), lambda a: int(a[0]), lambda a: bool(a[1]),
             lambda a: a.tolist(), lambda a: jax.device_get(a), lambda a: a[0].item(), lambda a: [1, 2, 3][a[0]],
             lambda a: np.asarray([a, a])]
    for read in reads:
        with host_reads() as outside:
            read(jax.numpy.arange(3) + 1)
        assert len(outside) >= 1, read
    with host_reads() as outside:
        fetch({"x": jax.numpy.arange(3) + 1})
        jax.numpy.arange(3).sum()  # device work without a read
    assert outside == []


def test_parse_eagle3_program_equals_the_reference_path():
    """parse+eagle3: verification with feature taps, then the EAGLE-3 continuation, in the one program."""
    from tests.speculation.test_eagle3 import ENGINE_PROMPTS, _engine_pair, random_head

    target, draft = _engine_pair()
    eng = ParseEngine(target, draft, ParseConfig(schedule="fixed", max_draft_tokens=10, segmenter="stride", stride=3,
                                                 threshold=0.5, rounds="single"),
                      eagle3=random_head(target, 43))
    ref = ReferenceParse(eng)
    for prompts in (ENGINE_PROMPTS[:1], ENGINE_PROMPTS):
        got = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=16)
        expect = ref.generate(prompts, mode="parse+eagle3", max_new_tokens=16)
        assert got.tokens == expect.tokens and got.stats["accepted_tokens"] == expect.stats["accepted_tokens"]


@pytest.mark.parametrize("policy,batch", [("earliest_error", 4), ("longest_valid", 1)])
def test_single_round_step_metrics_are_the_drafts_own_scores(policy, batch):
    """PARSE's per-step metrics (parse_jax/runtime/metrics.py) of a single round, against the draft's answers
    scored on the host (`prefix_scores`): steps drafted, the first rejected step of each pass, the judge scores of
    the accepted prefixes and of the others, accepted tokens per verification."""
    from parse_jax.runtime.metrics import SCORE_BINS
    from parse_jax.verify.scoring import accept

    base = dict(segmenter="stride", stride=3, policy=policy, rounds="single", max_draft_tokens=12, max_prefixes=5,
                schedule="fixed")
    threshold = _threshold_with_partial_acceptance(ParseEngine(TARGET, DRAFT, ParseConfig(**base)))
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**base, threshold=threshold))
    prompts = PROMPTS[:batch]
    drafts = generate(DRAFT, prompts, max_new_tokens=12, eos_ids=[]).tokens
    ids = [[TOK.bos_id] + TOK.encode(p) for p in prompts]
    first = [0] * 6
    kept_hist, other_hist = [0] * SCORE_BINS, [0] * SCORE_BINS
    steps = accepted_tokens = 0
    for c, d in zip(ids, drafts):
        bounds = eng.boundaries(d)
        scores = eng.prefix_scores(c, d, bounds)
        fail = [k for k, x in enumerate(scores) if not x >= threshold]
        first[fail[0] if fail else 5] += 1
        idx = int(accept(scores[None], np.ones((1, len(scores)), bool), threshold, policy)[0])
        for k, x in enumerate(scores):
            (kept_hist if k <= idx else other_hist)[min(int(x * SCORE_BINS), SCORE_BINS - 1)] += 1
        steps += len(bounds)
        accepted_tokens += bounds[idx] if idx >= 0 else 0
    s = eng.generate(prompts, mode="parse", max_new_tokens=16, eos_ids=[]).stats
    assert s["first_rejected_step_hist"] == first and sum(first[:5]) > 0  # some passes rejected a step
    assert s["accepted_score_hist"] == kept_hist and s["rejected_score_hist"] == other_hist
    assert s["num_steps_drafted"] == steps == sum(s["prefixes_per_request"])
    assert s["num_verifications"] == batch and s["accepted_tokens"] == accepted_tokens
    assert s["accepted_tokens_per_verification"] == pytest.approx(accepted_tokens / batch)


def test_multi_round_step_metrics_count_every_pass():
    base = dict(segmenter="stride", stride=3, rounds="multi", max_draft_tokens=9, max_prefixes=3, max_segment=4,
                schedule="fixed")
    threshold = _threshold_with_partial_acceptance(ParseEngine(TARGET, DRAFT, ParseConfig(**base)))
    eng = ParseEngine(TARGET, DRAFT, ParseConfig(**base, threshold=threshold))
    s = eng.generate(PROMPTS, mode="parse", max_new_tokens=20, eos_ids=[]).stats
    passes = s["num_verifications"]
    assert sum(s["first_rejected_step_hist"]) == passes >= s["rounds"] >= 2  # every live row's pass, once
    assert sum(s["accepted_score_hist"]) + sum(s["rejected_score_hist"]) == s["num_steps_drafted"]
    assert s["num_steps_drafted"] == sum(s["prefixes_per_request"])
    assert s["accepted_tokens_per_verification"] == pytest.approx(s["accepted_tokens"] / passes)


def test_a_row_whose_boundary_token_is_eos_ends_there_not_continued():
    """Greedy, a row with tokens left whose next token at the accepted boundary is EOS ends at the verification
    (that token written with no pass): it is not a continued row, in parse and sequential, fused or served. Not one
    whose budget is spent, nor any row when sampling."""
    import jax.numpy as jnp

    from parse_jax.modes.parse import boundary_stop
    from parse_jax.runtime.sampling import Sampler

    logits = jnp.array([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 5.0, 1.0], [0.0, 1.0, 9.0]])  # argmax 1, 0, 1, 2
    remaining = jnp.array([4, 4, 0, 4])
    eos = jnp.array([1, 2])
    stop = boundary_stop(logits, remaining, eos, Sampler(greedy=True))
    assert stop.tolist() == [True, False, False, True]  # row 2: its budget is spent (not live), not a stop
    assert not boundary_stop(logits, remaining, eos, Sampler(greedy=False)).any()

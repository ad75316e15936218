"""The jitted target-only loop: greedy identity with a plain forward, ragged batches, EOS, budgets."""

import numpy as np
import pytest

from parse_jax.errors import InputError
from parse_jax.runtime.decode import generate
from parse_jax.runtime.programs import bucket, compiled_programs, length_bucket
from tests.random_models import random_model


def _greedy_by_full_forward(model, prompt, n):
    """Causal, so right padding leaves earlier logits alone: one compiled shape for every step."""
    seq = list(prompt)
    total = len(prompt) + n
    for _ in range(n):
        padded = np.array([seq + [0] * (total - len(seq))])
        seq.append(int(model.logits(padded)[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("family,seed", [("llama3", 4), ("qwen2", 5), ("qwen3", 6)])
def test_greedy_loop_equals_argmax_of_full_forward(family, seed):
    model = random_model(family, seed)
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, 9).tolist()
    res = generate(model, [prompt], max_new_tokens=12)
    assert res.tokens[0] == _greedy_by_full_forward(model, prompt, 12)
    assert res.stats["new_tokens"] == 12 and res.stats["target_passes"] == 12


def test_ragged_batch_equals_each_prompt_alone():
    model = random_model("qwen3", 7)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (3, 17, 9, 1, 12)]
    batch = generate(model, prompts, max_new_tokens=10)
    for p, toks in zip(prompts, batch.tokens):
        assert generate(model, [p], max_new_tokens=10).tokens[0] == toks
    sampled = generate(model, prompts, max_new_tokens=10, temperature=0.8, top_k=20, seed=11)
    assert [len(t) for t in sampled.tokens] == [10] * 5


def test_per_row_eos_stops_each_row_at_its_first_eos():
    model = random_model("llama3", 8)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (5, 8, 11)]
    free = generate(model, prompts, max_new_tokens=16).tokens
    eos = free[0][4]  # a token row 0 really produces
    stopped = generate(random_model("llama3", 8, eos_token_ids=(eos,)), prompts, max_new_tokens=16).tokens
    for row_free, row in zip(free, stopped):
        expect = row_free[: row_free.index(eos) + 1] if eos in row_free else row_free
        assert row == expect
    assert len(stopped[0]) <= 5


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = random_model("qwen2", 9)
    prompts = [[1, 2, 3, 4], [5, 6]]
    a = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=1).tokens
    b = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=1).tokens
    c = generate(model, prompts, max_new_tokens=12, temperature=1.0, seed=2).tokens
    assert a == b and a != c
    greedy = generate(model, prompts, max_new_tokens=12).tokens
    assert generate(model, prompts, max_new_tokens=12, temperature=1.5, top_k=1, seed=3).tokens == greedy
    assert generate(model, prompts, max_new_tokens=12, temperature=1.5, top_p=1e-6, seed=3).tokens == greedy


def test_padding_buckets_bound_the_number_of_programs():
    model = random_model("qwen3", 10)
    generate(model, [[1] * 5], max_new_tokens=20)
    before = compiled_programs()
    for n in (6, 7, 8):
        generate(model, [[2] * n, [3] * (n - 2)], max_new_tokens=17 + n)
    assert compiled_programs() - before <= 1  # batch 2 is a new bucket; prompt and budget buckets are shared
    assert bucket(5) == 8 and bucket(9) == 16 and bucket(1, 1) == 1


def test_length_buckets_are_two_per_octave_and_pad_less_than_a_third():
    sizes = sorted({length_bucket(n) for n in range(1, 1025)})
    assert sizes[:8] == [8, 12, 16, 24, 32, 48, 64, 96] and sizes[-1] == 1024
    for n in range(1, 1025):
        b = length_bucket(n)
        assert b >= max(n, 8) and (n <= 8 or b < 1.5 * n)
        assert length_bucket(b) == b


def test_bad_requests_are_clear_errors():
    model = random_model("qwen3", 11)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []])
    with pytest.raises(InputError, match="cache holds 40"):
        generate(model, [[1] * 30], max_new_tokens=20, max_cache_len=40)
    with pytest.raises(InputError, match="cache holds 512"):
        generate(model, [[1] * 500], max_new_tokens=20)
    with pytest.raises(InputError, match="outside"):
        generate(model, [[1, 10_000]])
    with pytest.raises(InputError, match="temperature"):
        generate(model, [[1]], temperature=-1.0)
    with pytest.raises(InputError, match="top_p"):
        generate(model, [[1]], temperature=1.0, top_p=0.0)
    with pytest.raises(InputError, match="tokenizer"):
        generate(model, ["text prompt"])
    with pytest.raises(InputError, match="single string"):
        generate(model, "text prompt")


def test_kept_probabilities_are_the_models_softmax_at_each_emitted_token():
    """`decode_loop` with `Sampler(keep_probs=True)` (what PARSE's confidence-chosen prefixes read from the draft):
    each emitted token's probability under the model's softmax, as a full causal forward over prompt + tokens gives
    it; 1 past the end of a row."""
    import jax
    import jax.numpy as jnp

    from parse_jax.models.decoder import Decoder
    from parse_jax.runtime.decode import decode_loop, prefill
    from parse_jax.runtime.programs import forward_fn
    from parse_jax.runtime.requests import SamplingParams
    from parse_jax.runtime.sampling import Sampler

    model = random_model("qwen3", 8)
    prompts = np.random.default_rng(8).integers(0, model.config.vocab_size, (2, 6)).astype(np.int32)
    max_new = np.array([7, 3], np.int32)

    @jax.jit
    def run(params, prompt):
        forward = forward_fn(Decoder(model.config, model.attention_impl), params)
        cache, first = prefill(forward, model.config, prompt, jnp.full((2,), 6, jnp.int32), 32)
        args = SamplingParams().args(2)
        s = decode_loop(forward, cache, first, max_new=max_new, eos_ids=jnp.full((1,), -1, jnp.int32),
                        sampler=Sampler(greedy=True, keep_probs=True), args=args, num_new=8)
        return s.tokens, s.num_new, s.probs

    tokens, num, probs = (np.asarray(x) for x in run(model.params, prompts))
    for i in range(2):
        n = int(num[i])
        logits = model.logits(np.concatenate([prompts[i], tokens[i, :n]])[None])[0, 5:5 + n]
        soft = np.exp(logits - logits.max(-1, keepdims=True))
        soft /= soft.sum(-1, keepdims=True)
        np.testing.assert_allclose(probs[i, :n], soft[np.arange(n), tokens[i, :n]], rtol=2e-5, atol=1e-6)
        assert (probs[i, n:] == 1.0).all()
    assert num.tolist() == [7, 3]

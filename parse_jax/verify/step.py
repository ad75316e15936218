"""The target's step in multi-round PARSE: it writes from the accepted boundary up to its next step end, where the
delimiter automaton (`segment.DelimiterTable`) ends an occurrence. The automaton's state carries from token to
token (as the draft's segmentation carries it over the draft), so a delimiter that the tokenizer writes over two
tokens ends the step too, not only a token that holds a whole delimiter.

`step_loop` writes token by token and stops there; `cut_at_step_end` cuts tokens already written several per pass
(an EAGLE-3 continuation, which stops by itself only at single-token step ends) at the first one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.models.cache import KVCache
from parse_jax.models.decoder import causal_metadata
from parse_jax.runtime.decode import is_eos
from parse_jax.runtime.requests import PAD_ID
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.verify.segment import delimiter_scan


@struct.dataclass
class StepStop:
    """Where a target's step ends: an EOS id, or a delimiter occurrence ending under the automaton `table`, run from
    each row's `state` [B] (the state after the output so far)."""

    eos_ids: jax.Array
    table: jax.Array
    state: jax.Array


@struct.dataclass
class StepState:
    cache: KVCache
    tokens: jax.Array   # [B, num_new]
    num_new: jax.Array  # [B]
    done: jax.Array     # [B]
    last: jax.Array     # [B]
    step: jax.Array     # scalar: tokens sampled (the first from `first_logits`, then one target pass each)
    state: jax.Array    # [B] the automaton's state after the row's last token


def step_loop(forward, cache: KVCache, first_logits: jax.Array, *, max_new: jax.Array, stop: StepStop,
              sampler: Sampler, args: SamplingArgs, num_new: int) -> StepState:
    """`runtime.decode.decode_loop` (the same samples: step i draws with `args.fold(i)`) that also stops a row after
    the token that ends a delimiter occurrence, the automaton's state carried from `stop.state` token to token."""
    b = first_logits.shape[0]

    def emit(s: StepState, step_logits: jax.Array) -> StepState:
        tok = sampler.sample(step_logits, args.fold(s.step))
        tok = jnp.where(s.done, PAD_ID, tok)
        entry = stop.table[s.state, tok]
        ended = entry % 2 == 1
        num = s.num_new + (~s.done).astype(jnp.int32)
        done = s.done | is_eos(tok, stop.eos_ids) | ended | (num >= max_new)
        return s.replace(tokens=s.tokens.at[:, s.step].set(tok), num_new=num, done=done, last=tok,
                         step=s.step + 1, state=jnp.where(s.done, s.state, entry // 2))

    s = StepState(cache=cache, tokens=jnp.full((b, num_new), PAD_ID, jnp.int32), num_new=jnp.zeros((b,), jnp.int32),
                  done=max_new <= 0, last=jnp.zeros((b,), jnp.int32), step=jnp.int32(0), state=stop.state)
    s = emit(s, first_logits)
    one_limit, one_group = causal_metadata(b, 1)

    def body(s: StepState) -> StepState:
        logits, c = forward(s.last[:, None], s.cache.lengths[:, None], s.cache, one_limit, one_group)
        return emit(s.replace(cache=c.commit((~s.done).astype(jnp.int32))), logits[:, 0])

    return jax.lax.while_loop(lambda s: (s.step < num_new) & ~jnp.all(s.done), body, s)


def cut_at_step_end(tokens: jax.Array, count: jax.Array, table: jax.Array,
                    state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's `tokens[:count]` cut after the first token that ends a delimiter occurrence (the automaton run
    from `state`): (the count kept [B], the automaton's state after the last kept token [B])."""
    states, ends = delimiter_scan(tokens, table, state)
    t = jnp.arange(tokens.shape[1])[None, :]
    ends = ends & (t < count[:, None])
    kept = jnp.where(ends.any(axis=1), jnp.argmax(ends, axis=1) + 1, count).astype(jnp.int32)
    after = jnp.take_along_axis(states, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    return kept, jnp.where(kept > 0, after, state)

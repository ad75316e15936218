"""EAGLE-3 chain (and tree) drafting with a head (`head.py`): gamma head steps, then ONE target pass verifying them
(and any sibling leaves, `tree.py`), lossless acceptance, all in one jitted program; also the target's continuation
from a committed cache (PARSE's accepted boundary, mode `parse+eagle3`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from parse_jax.errors import ConfigError, InputError, ParseJaxError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import ModelConfig
from parse_jax.models.decoder import Decoder, causal_metadata
from parse_jax.runtime.programs import fetch, forward_fn, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Request, SamplingParams
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.settings import Eagle3Settings, check_setting
from parse_jax.speculation.draft_model import (
    accept_proposals,
    emit_accepted,
    position_hits,
    spec_args,
    spec_batch,
    spec_request,
    spec_result,
)
from parse_jax.speculation.eagle3.head import (
    Eagle3,
    Eagle3Config,
    Eagle3Head,
    check_head,
    draft_logits,
    embed,
    head_module,
    layer_params,
    target_taps,
    to_target_vocab,
)
from parse_jax.speculation.eagle3.tree import (
    Tree,
    accept_path,
    compact_kv,
    expand,
    expand_spine,
    layout,
    slots_needed,
)
from parse_jax.utils.validation import check_model


@struct.dataclass
class EagleState:
    target_cache: KVCache
    head_cache: KVCache      # one entry per committed target position (same lengths as the target's; left as
                             # given, `EagleContext.head_cache` or empty, by a start whose every row ended at its
                             # first token and finished, `eagle_start`)
    h_last: jax.Array        # [B, d] head output at the last committed position: drafts the token after `last`
    logits_last: jax.Array   # [B, V] its logits
    tokens: jax.Array        # [B, width] emitted ids
    num_new: jax.Array
    done: jax.Array
    last: jax.Array          # [B] last emitted token, not yet in the target's cache
    rounds: jax.Array        # target passes
    accepted: jax.Array      # [B] drafted tokens accepted
    proposed: jax.Array      # [B] drafted tokens proposed (tree: the nodes verified)
    drafts: jax.Array        # [B] verification passes the row was live in (num_drafts)
    per_pos: jax.Array       # [B, gamma] drafts whose token at each depth was accepted
    side: jax.Array          # [B] tree rounds whose accepted path left the trunk (a side leaf was taken)
    keys: jax.Array          # [B, 2] each row's key: its round r draws with `fold_in(key, r)` (r: its `drafts`)


class EagleFns(NamedTuple):
    """The functions an EAGLE-3 loop calls inside a jit (`head_applies`): the target with its taps, the head, and
    the target's LM head."""

    target: Callable
    head: Callable
    lm: Callable


@struct.dataclass
class EagleContext:
    """What the target has read before the loop starts: its tokens [B, L] and taps [B, L, 3d], how many count per
    row [B], and the target's next-token logits after them [B, V].

    `head_cache`: the head's cache the context continues (its entries come first, the context's positions after
    them: a multi-round PARSE step, whose head carries from round to round); None, a fresh one. `finishes` [B]:
    the rows whose answer ends if they end at their first token (None: every row); where a row stops at its first
    token without finishing (a step end), a later call reads the head's cache, so its pass over the context runs."""

    tokens: jax.Array
    features: jax.Array
    length: jax.Array
    first_logits: jax.Array
    head_cache: KVCache | None = None
    finishes: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class EagleLoop:
    """The static settings of an EAGLE-3 drafting loop (one program per value): `gamma` the draft depth; `tree` > 0
    (greedy only): a tree of gamma + tree nodes, `tree_top_k` children per node, `tree_width` paths drafted per
    depth (`tree.py`), instead of the chain."""

    config: Eagle3Config
    gamma: int
    num_new: int
    tree: int = 0          # tree nodes beyond the chain's gamma (0: the chain)
    first_pass: int = 0    # target passes already made: 1 after a prefill, 0 from a PARSE boundary
    tree_top_k: int = 4    # tree: children per node (and frontier nodes per depth, unless tree_width)
    tree_width: int = 0    # tree: frontier nodes per depth (0: tree_top_k; 1: the spine, `tree.expand_spine`)

    @classmethod
    def of(cls, config: Eagle3Config, settings: Eagle3Settings, *, num_new: int, first_pass: int = 0) -> EagleLoop:
        """The loop of `settings` (an `Eagle3Settings`, or an `EagleSpec`: gamma, tree, tree_top_k, tree_width)."""
        return cls(config=config, gamma=settings.gamma, num_new=num_new, tree=settings.tree, first_pass=first_pass,
                   tree_top_k=settings.tree_top_k, tree_width=settings.tree_width)

    @property
    def frontier(self) -> int:
        """Tree paths the head drafts per depth (`tree_width`, 0: `tree_top_k`; never more than `tree_top_k`)."""
        return min(self.tree_width or self.tree_top_k, self.tree_top_k)

    @property
    def slots(self) -> int:
        """Cache slots a round writes past the committed length (target block, head drafting)."""
        return slots_needed(self.gamma, self.tree, self.tree_top_k, self.tree_width)


def first_token(first_logits: jax.Array, sampler: Sampler, args: SamplingArgs) -> jax.Array:
    """The token an EAGLE-3 loop emits first, from the target's logits after its context (no head involved)."""
    return sampler.sample(first_logits, args.fold(2**31 - 1))


def eagle_start(fns: EagleFns, target_cache: KVCache, ctx: EagleContext, *, loop: EagleLoop, max_new: jax.Array,
                eos_ids: jax.Array, sampler: Sampler, args: SamplingArgs) -> EagleState:
    """From a target cache holding `ctx.length` context tokens and the target's taps at those positions: emit the
    first token from `ctx.first_logits` and fill the head's cache (one head pass over the context, after the
    entries of `ctx.head_cache` where given). Where every row ends at that token and its answer with it (EOS, a
    budget of one: an answer PARSE accepted whole; `ctx.finishes`), nothing reads the head's state: the pass is
    skipped (`lax.cond`), the head cache left as it was and `h_last`/`logits_last` zero."""
    _, head_apply, lm = fns
    first_logits, ctx_tokens, ctx_feats, n = ctx.first_logits, ctx.tokens, ctx.features, ctx.length
    b = first_logits.shape[0]
    if ctx.head_cache is None:
        head_cache, base = KVCache.init(loop.config.layer, b, target_cache.max_len), 0
    else:
        head_cache, base = ctx.head_cache, ctx.head_cache.lengths[:, None]
    rows = jnp.arange(b)
    width = loop.num_new + loop.gamma + 1
    first = first_token(first_logits, sampler, args)
    # the head's entry for position t reads x_{t+1}: the context shifted by one, then the first emitted token
    shifted = jnp.concatenate([ctx_tokens[:, 1:], ctx_tokens[:, :1]], axis=1)
    shifted = shifted.at[rows, n - 1].set(first)
    length = ctx_tokens.shape[1]
    limit, group = causal_metadata(b, length)
    positions = jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32)[None, :] + base, (b, length))
    done = (max_new <= 0) | jnp.any(first[:, None] == eos_ids[None, :], -1) | (max_new <= 1)
    finished = done if ctx.finishes is None else done & ctx.finishes

    def fill(cache: KVCache):
        out, normed, cache = head_apply(shifted, ctx_feats, True, positions, cache, limit, group)
        return cache.commit(n), out[rows, n - 1], lm(normed[rows, n - 1])

    def skip(cache: KVCache):
        _, h, logits = jax.eval_shape(fill, cache)
        return cache, jnp.zeros(h.shape, h.dtype), jnp.zeros(logits.shape, logits.dtype)

    # a batch whose every row ends here (an answer accepted whole) reads nothing more
    head_cache, h_last, logits_last = jax.lax.cond(jnp.all(finished), skip, fill, head_cache)
    tokens = jnp.full((b, width), PAD_ID, jnp.int32).at[:, 0].set(jnp.where(max_new > 0, first, PAD_ID))
    zeros = jnp.zeros((b,), jnp.int32)
    return EagleState(target_cache=target_cache, head_cache=head_cache, h_last=h_last, logits_last=logits_last,
                      tokens=tokens, num_new=jnp.minimum(max_new, 1),
                      done=done, last=first, rounds=jnp.int32(loop.first_pass), accepted=zeros, proposed=zeros,
                      drafts=zeros, per_pos=jnp.zeros((b, loop.gamma), jnp.int32), side=zeros, keys=args.key)


def _draft_chain(fns: EagleFns, state: EagleState, gamma: int, sampler: Sampler, args: SamplingArgs,
                 a_draft: SamplingArgs):
    """gamma proposals: the first from `logits_last`, then gamma - 1 head steps on the head's own outputs.
    Returns (props [B, gamma], q [B, gamma, V] the distributions they were drawn from)."""
    q1 = sampler.probs(state.logits_last, args)
    d1 = sampler.sample(state.logits_last, a_draft.fold(0))
    if gamma == 1:
        return d1[:, None], q1[:, None]
    head_step = _head_step(fns, state.head_cache.lengths)

    def step(carry, k):
        cache, tok, hidden = carry
        cache, out, logits = head_step(cache, tok, hidden, k - 1)
        nxt = sampler.sample(logits, a_draft.fold(k))
        return (cache, nxt, out), (nxt, sampler.probs(logits, args))

    _, (rest, qs) = jax.lax.scan(step, (state.head_cache, d1, state.h_last), jnp.arange(1, gamma))
    props = jnp.concatenate([d1[:, None], rest.T], axis=1)
    return props, jnp.concatenate([q1[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)


def _tree_step(fns: EagleFns, head_cache: KVCache) -> Callable:
    """The head over k paths at once (`tree.expand`'s step): each path one prefix group over the committed head
    cache, so every node sees exactly its ancestors; the path's token at depth i sits at RoPE position base + i."""
    _, head_apply, lm = fns

    def step(path_tok, path_hid):
        b, k, t = path_tok.shape
        pos = head_cache.lengths[:, None] + 1 + jnp.tile(jnp.arange(t, dtype=jnp.int32), k)[None]
        group = jnp.broadcast_to(jnp.repeat(jnp.arange(1, k + 1, dtype=jnp.int32), t)[None], (b, k * t))
        out, normed, _ = head_apply(path_tok.reshape(b, k * t), path_hid.reshape(b, k * t, -1), False, pos,
                                    head_cache, jnp.zeros((b, k * t), jnp.int32), group)
        last = lambda x: x.reshape(b, k, t, -1)[:, :, -1]  # noqa: E731
        return last(out), lm(last(normed))

    return step


def _head_step(fns: EagleFns, base: jax.Array) -> Callable:
    """The head one token on (the chain's drafting step, and `tree.expand_spine`'s): the depth-(i + 1) token at RoPE
    position base + i + 1, its entry committed to the head's cache (a round's drafting entries are written over
    later)."""
    _, head_apply, lm = fns

    def step(cache: KVCache, token, hidden, i: int):
        limit, group = causal_metadata(token.shape[0], 1)
        out, normed, cache = head_apply(token[:, None], hidden[:, None], False, (base + i + 1)[:, None], cache,
                                        limit, group)
        return cache.commit(1), out[:, 0], lm(normed[:, 0])

    return step


def draft_tree(fns: EagleFns, state: EagleState, loop: EagleLoop) -> Tree:
    """The round's tree: one path wide, the spine on the head's cache (`tree.expand_spine`), or EAGLE-2's expansion
    of `loop.frontier` paths, each re-reading its path (`tree.expand`)."""
    nodes = loop.gamma + loop.tree
    if loop.frontier == 1:
        return expand_spine(_head_step(fns, state.head_cache.lengths), state.head_cache, state.h_last,
                            state.logits_last, depth=loop.gamma, k=loop.tree_top_k, nodes=nodes)
    return expand(_tree_step(fns, state.head_cache), state.h_last, state.logits_last, depth=loop.gamma,
                  k=loop.tree_top_k, nodes=nodes, width=loop.frontier)


def eagle_round(fns: EagleFns, state: EagleState, *, loop: EagleLoop, max_new: jax.Array, eos_ids: jax.Array,
                sampler: Sampler, args: SamplingArgs) -> EagleState:
    """One round: draft (the chain of `loop.gamma`, or the tree), ONE target pass verifying every drafted token,
    acceptance (lossless for the chain; greedy for the tree), the accepted path committed to both caches and the
    head's state taken from the path's taps."""
    target_fwd, head_apply, lm = fns
    gamma, tree = loop.gamma, loop.tree
    b = state.last.shape[0]
    rows = jnp.arange(b)
    a_draft, a_accept, a_fix = args.with_keys(state.keys).fold(state.drafts).split(3)  # the row's own round
    start = state.target_cache.lengths[:, None]
    side = jnp.zeros((b,), jnp.int32)
    if tree:
        lay = layout(draft_tree(fns, state, loop), state.last, gamma)
        logits, t_cache, feats = target_fwd(lay.tokens, start + lay.depth, state.target_cache, lay.limit, lay.group)
        n_acc, emitted, slots = accept_path(lay, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        t_cache = compact_kv(t_cache, start[:, 0], slots, n_acc)
        feats = jnp.take_along_axis(feats, slots[..., None], axis=1)  # the taps along the accepted path
        side = (slots[rows, n_acc] > n_acc).astype(jnp.int32)  # its last token sits past the trunk's slots
    else:
        props, q = _draft_chain(fns, state, gamma, sampler, args, a_draft)
        block = jnp.concatenate([state.last[:, None], props], axis=1)  # [B, gamma + 1]
        blk_limit, blk_group = causal_metadata(b, gamma + 1)
        pos = start + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
        logits, t_cache, feats = target_fwd(block, pos, state.target_cache, blk_limit, blk_group)
        p = sampler.probs(logits, args)
        n_acc, emitted = accept_proposals(p, q, props, sampler, a_accept.key, a_fix.key)
    tokens, num, done, last, commit = emit_accepted(state.tokens, state.num_new, state.done, state.last,
                                                    emitted, n_acc, eos_ids, max_new)
    live = (~state.done).astype(jnp.int32)
    # the head's entries for the verified path: tokens emitted, features from this same target pass
    w = emitted.shape[1]
    h_limit, h_group = causal_metadata(b, w)
    h_pos = start + 1 + jnp.arange(w, dtype=jnp.int32)[None]
    out, normed, h_cache = head_apply(emitted, feats[:, :w], True, h_pos, state.head_cache, h_limit, h_group)
    return state.replace(
        target_cache=t_cache.commit(commit), head_cache=h_cache.commit(commit),
        h_last=jnp.where(live[:, None] > 0, out[rows, n_acc], state.h_last),
        logits_last=jnp.where(live[:, None] > 0, lm(normed[rows, n_acc]), state.logits_last),
        tokens=tokens, num_new=num, done=done, last=last, rounds=state.rounds + 1,
        accepted=state.accepted + n_acc * live, proposed=state.proposed + (gamma + tree) * live,
        drafts=state.drafts + live, per_pos=state.per_pos + position_hits(n_acc, gamma, live),
        side=state.side + side * live)


def eagle_loop(fns: EagleFns, target_cache: KVCache, ctx: EagleContext, *, loop: EagleLoop, max_new: jax.Array,
               eos_ids: jax.Array, sampler: Sampler, args: SamplingArgs) -> EagleState:
    """`eagle_start`, then `eagle_round` until every row is done (one `lax.while_loop`)."""
    kw = dict(loop=loop, max_new=max_new, eos_ids=eos_ids, sampler=sampler, args=args)
    state = eagle_start(fns, target_cache, ctx, **kw)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: eagle_round(fns, s, **kw), state)


def head_applies(target_cfg: ModelConfig, cfg: Eagle3Config, impl: str, target_params, head_params):
    """The target with its taps, the head (its own embedding table or the target's) and the LM head: the head's
    logits placed at target ids (a draft vocabulary's through `d2t`, every other id masked)."""
    target = Decoder(target_cfg, impl)
    head = head_module(cfg, impl)
    layer = {"params": layer_params(head_params)}

    forward = forward_fn(target, target_params, return_hidden=True)

    def target_fwd(tokens, positions, cache, limit, group):
        logits, cache, hiddens = forward(tokens, positions, cache, limit, group)
        return logits, cache, target_taps(hiddens, cfg.taps)

    def head_apply(tokens, hidden, fuse: bool, positions, cache, limit, group):
        if fuse:
            hidden = head.apply(layer, hidden, method=Eagle3Head.fuse)
        return head.apply(layer, embed(head_params, target_params, tokens), hidden, positions, cache, limit, group)

    def lm(normed):
        logits = draft_logits(head_params, target_params, target_cfg, normed)
        return to_target_vocab(head_params, logits, target_cfg.vocab_size)

    return EagleFns(target_fwd, head_apply, lm)


def prefill_with_taps(fns: EagleFns, cfg: ModelConfig, prompt, prompt_lens, cache_len: int):
    """(the target's cache holding each prompt, the context EAGLE-3 starts from: the prompts, their taps and the
    target's logits after each): one causal pass, inside the callers' jit."""
    b, p = prompt.shape
    limit, group = causal_metadata(b, p)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache, feats = fns.target(prompt, positions, KVCache.init(cfg, b, cache_len), limit, group)
    ctx = EagleContext(tokens=prompt, features=feats, length=prompt_lens,
                       first_logits=logits[jnp.arange(b), prompt_lens - 1])
    return cache.commit(prompt_lens), ctx


@functools.cache
def generate_program(target_cfg: ModelConfig, impl: str, cache_len: int, loop: EagleLoop, sampler: Sampler):
    """Target + EAGLE-3 from prompts: one target prefill (with feature taps), then `eagle_loop`."""
    num_new = loop.num_new

    def run(target_params, head_params, prompt, prompt_lens, max_new, eos_ids, args: SamplingArgs):
        fns = head_applies(target_cfg, loop.config, impl, target_params, head_params)
        cache, ctx = prefill_with_taps(fns, target_cfg, prompt, prompt_lens, cache_len)
        state = eagle_loop(fns, cache, ctx, loop=loop, max_new=max_new, eos_ids=eos_ids, sampler=sampler, args=args)
        return (state.tokens[:, :num_new], state.num_new, state.rounds, state.accepted, state.proposed,
                state.drafts, state.per_pos, state.side)

    return register_program(jax.jit(run))


@functools.cache
def continue_program(target_cfg: ModelConfig, impl: str, loop: EagleLoop, sampler: Sampler):
    """The target's continuation with EAGLE-3 from a committed cache (PARSE's accepted boundary): the context's
    taps come from the verification pass that scored the prefixes, so nothing is recomputed."""
    num_new = loop.num_new

    def run(target_params, head_params, cache, ctx: EagleContext, max_new, eos_ids, args: SamplingArgs):
        fns = head_applies(target_cfg, loop.config, impl, target_params, head_params)
        state = eagle_loop(fns, cache, ctx, loop=loop, max_new=max_new, eos_ids=eos_ids, sampler=sampler,
                           args=args)
        return state.tokens[:, :num_new], state.num_new, state.rounds, state.accepted, state.proposed

    return register_program(jax.jit(run))


def eagle3_generate(target, head: Eagle3, prompts: Sequence[str] | Sequence[Sequence[int]], *, gamma: int = 4,
                    max_new_tokens: int | Sequence[int] = 256, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | Sequence[int] = 0, add_bos: bool = True,
                    eos_ids: Sequence[int] | None = None, tree: int = 0, tree_top_k: int = 4,
                    tree_width: int = 0) -> GenerateResult:
    """Target + EAGLE-3 drafting, lossless: greedy output equals the target's; sampled output follows the target's
    distribution (rejection sampling against the head's distribution). `tree` > 0 (greedy only): instead of the
    chain of `gamma`, a tree of depth `gamma` and `gamma + tree` nodes, `tree_width` paths drafted per depth
    (0: `tree_top_k`) and `tree_top_k` children proposed per node, all verified in one target pass
    (docs/design.md, EAGLE-3). A head loaded without its target runs in the target's dtype, cast on each call:
    `pj.load_eagle3(path, target)` loads it cast once."""
    check_model("target", target, error=InputError)
    head = check_head("head", head).for_target(target.config)  # checked, in the target's dtype
    given = {name: check_setting(Eagle3Settings, name, value, error=InputError) for name, value in
             (("gamma", gamma), ("tree", tree), ("tree_top_k", tree_top_k), ("tree_width", tree_width))}
    try:
        eagle = Eagle3Settings(**given)
    except ConfigError as e:  # the settings' joint checks (tree_width within tree_top_k, ...): arguments here
        raise InputError(str(e)) from None
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    check_tree(eagle.tree, sampling.temperature, error=InputError)
    req = spec_request(target, prompts, max_new_tokens, sampling, add_bos, eos_ids)
    return eagle3_speculate(target, head, req, eagle)


def eagle3_speculate(target, head: Eagle3, req: Request, eagle: Eagle3Settings) -> GenerateResult:
    """EAGLE-3 drafting of a validated request (mode `eagle3`) with the drafting settings `eagle`."""
    program, sb = eagle3_launch(target, head, req, eagle)
    t0 = time.perf_counter()
    out = fetch(program(*spec_args(target, head.params, sb)))
    res = spec_result(target, sb.ids, out[:7], time.perf_counter() - t0, eagle.gamma)
    res.stats.update(tree_stats(eagle, out[7][: len(sb.ids)].sum()))
    return res


def tree_stats(eagle: Eagle3Settings, side_paths) -> dict:
    """A result's tree figures: its settings, and the rounds whose accepted path left the trunk (a side leaf won)."""
    if not eagle.tree:
        return {"tree": 0}
    return {"tree": eagle.tree, "tree_top_k": eagle.tree_top_k, "tree_width": eagle.tree_width or eagle.tree_top_k,
            "tree_side_paths": int(side_paths)}


def eagle3_launch(target, head: Eagle3, req: Request, eagle: Eagle3Settings):
    """(program, prepared batch) of EAGLE-3 drafting for `req`, not run (`draft_model.spec_args` gives its
    arguments; it returns spec_result's seven outputs, then the side paths per row)."""
    gamma = eagle.gamma
    loop = EagleLoop.of(head.config, eagle, num_new=0, first_pass=1)
    sb = spec_batch(target, req, gamma=gamma, capacity=target.config.max_position_embeddings,
                    extra_slots=loop.slots - gamma - 1)
    loop = dataclasses.replace(loop, num_new=sb.num_new)
    return generate_program(target.config, target.attention_impl, sb.cache_len, loop, sb.sampling.sampler), sb


def check_tree(tree: int, temperature: float, *, error: type[ParseJaxError] = ConfigError) -> None:
    """Tree drafting against a request's sampling: greedy only. `tree` from checked `Eagle3Settings` (its range is
    checked where they are built), `temperature` checked; `error`: InputError where they are a call's arguments."""
    if tree and temperature > 0:
        raise error("EAGLE-3 tree drafting is greedy only (temperature 0); use the chain (eagle3_tree=0) to sample")

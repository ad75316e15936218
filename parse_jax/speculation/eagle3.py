"""EAGLE-3: a one-layer draft head that reads the target's own hidden states, and chain drafting with it.

The head (Li et al., EAGLE-3, 2025) fuses the target's hidden states from a low, a middle and a high layer
(`fc`: 3d -> d), then runs ONE decoder layer whose attention input is [norm(token embedding) ; norm(feature)]
(2d wide), with the target's embedding table and LM head (frozen, shared). Its output hidden state is fed
back as the next step's feature, so it drafts several tokens per target pass.

Positions: the head's entry for target position t reads token x_{t+1} and the target's features at t, and sits at
RoPE position t + 1; its k-th own step from t reads the k-th drafted token at position t + 1 + k. Training-time
test (`ttt_logits`) unrolls exactly that: step k at t sees the step-0 entries of positions <= t and its own
steps 1..k at t, which is what chain drafting from t sees through the KV cache; the two agree to float32
rounding (tested).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import MASKED_LOGIT, ModelConfig, rope_inv_freq
from parse_jax.models.decoder import MLP, Attention, Decoder, RMSNorm, apply_rope, causal_metadata
from parse_jax.models.functional import linear, rms_norm
from parse_jax.runtime.programs import forward_fn, register_program
from parse_jax.runtime.requests import PAD_ID, GenerateResult, Request, SamplingParams
from parse_jax.runtime.sampling import Sampler, SamplingArgs
from parse_jax.speculation.draft_model import accept_proposals, emit_accepted, run_spec, spec_batch, spec_request

HEAD_CONFIG_FILE = "eagle3.json"
HEAD_PARAMS_DIR = "params"


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers (outputs of layers 2, L/2 and L-3), as indices into the decoder's
    `hiddens` (index i = the input of layer i = the output of layer i - 1); a target of 5 layers or fewer gets
    them clamped and sorted, some repeated."""
    def clamp(i: int) -> int:
        return min(max(i, 1), num_layers)

    low, mid, high = sorted((clamp(3), clamp(num_layers // 2 + 1), clamp(num_layers - 2)))
    return low, mid, high


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's layer (the target's width and attention shape, one layer) and what it was built for."""

    layer: ModelConfig
    taps: tuple[int, int, int]
    target_layers: int

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, taps: tuple[int, int, int] | None = None) -> Eagle3Config:
        taps = tuple(taps) if taps is not None else default_taps(target_cfg.num_layers)
        cfg = cls(layer=target_cfg.replace(num_layers=1), taps=taps, target_layers=target_cfg.num_layers)
        cfg.check_target(target_cfg)
        return cfg

    def check_target(self, target_cfg: ModelConfig) -> None:
        """A head reads one target's hidden states and logits through its LM head: refuse any other."""
        problems = []
        for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self.layer, name), getattr(target_cfg, name)
            if mine != theirs:
                problems.append(f"{name}: head {mine}, target {theirs}")
        if self.target_layers != target_cfg.num_layers:
            problems.append(f"num_layers: head built for {self.target_layers}, target has {target_cfg.num_layers}")
        if len(self.taps) != 3 or not all(1 <= t <= target_cfg.num_layers for t in self.taps):
            problems.append(f"taps {self.taps} must be 3 layer indices in [1, {target_cfg.num_layers}]")
        if problems:
            raise ConfigError("this EAGLE-3 head was trained for another target: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer.to_dict(), "taps": list(self.taps), "target_layers": self.target_layers}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        try:
            return cls(layer=ModelConfig.from_dict(d["layer"]), taps=tuple(int(t) for t in d["taps"]),
                       target_layers=int(d["target_layers"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed EAGLE-3 head config: {type(e).__name__}: {e}") from None


class Eagle3Head(nn.Module):
    """`fuse(features [B,T,3d]) -> [B,T,d]`; `__call__(embeds, hidden, ...) -> (out, normed, cache)`.

    `hidden` is the fused target feature (step 0) or the head's own previous `out` (later steps); `normed`
    goes through the target's LM head."""

    cfg: ModelConfig
    attention_impl: str = "xla"

    def setup(self) -> None:
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        self.fc = nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                           kernel_init=nn.initializers.normal(0.02))
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, self.attention_impl)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg)
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)

    def fuse(self, features: jax.Array) -> jax.Array:
        return self.fc(features)

    def __call__(self, embeds, hidden, positions, cache: KVCache, limit, group):
        x = jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(hidden)], axis=-1)
        h, k, v = self.self_attn(x, positions, cache.k[0], cache.v[0], cache.lengths, limit, group)
        residual = hidden + h
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out, self.norm(out), cache.replace(k=(k,), v=(v,))

    def init_all(self, embeds, features, positions, cache, limit, group):
        return self(embeds, self.fuse(features), positions, cache, limit, group)


@dataclasses.dataclass
class Eagle3:
    """A trained head: its config and params. `pj.load_eagle3(path, target)` returns one; it runs with its
    target's `attention_impl`."""

    config: Eagle3Config
    params: dict[str, Any]

    def __repr__(self) -> str:
        return f"Eagle3(hidden={self.config.layer.hidden_size}, taps={self.config.taps})"


def init_head(cfg: Eagle3Config, seed: int = 0) -> dict[str, Any]:
    """Random head params (normal, std 0.02) in the target's dtype."""
    d = cfg.layer.hidden_size
    module = Eagle3Head(cfg.layer)
    dtype = jnp.dtype(cfg.layer.dtype)
    embeds = jnp.zeros((1, 1, d), dtype)
    feats = jnp.zeros((1, 1, 3 * d), dtype)
    cache = KVCache.init(cfg.layer, 1, 1)
    one = jnp.ones((1, 1), jnp.int32)
    init = jax.jit(lambda key: module.init(key, embeds, feats, one, cache, one, one * 0,
                                           method=Eagle3Head.init_all)["params"])
    return init(jax.random.PRNGKey(seed))


def target_taps(hiddens: tuple[jax.Array, ...], taps: tuple[int, ...]) -> jax.Array:
    """[B, T, 3d]: the tapped hidden states of a decoder pass run with `return_hidden`."""
    return jnp.concatenate([hiddens[i] for i in taps], axis=-1)


def lm_head(target_params, target_cfg: ModelConfig, normed: jax.Array) -> jax.Array:
    """The target's own output projection (frozen, shared with the head): float32 logits, padded vocabulary rows
    masked as the decoder masks them."""
    if target_cfg.tie_word_embeddings:
        w = target_params["embed_tokens"]["embedding"]
        logits = jnp.einsum("...d,vd->...v", normed, w).astype(jnp.float32)
    else:
        logits = (normed @ target_params["lm_head"]["kernel"]).astype(jnp.float32)
    if target_cfg.vocab_limit is not None and target_cfg.vocab_limit < target_cfg.vocab_size:
        logits = jnp.where(jnp.arange(target_cfg.vocab_size) < target_cfg.vocab_limit, logits, MASKED_LOGIT)
    return logits


def embed(target_params, tokens: jax.Array) -> jax.Array:
    return target_params["embed_tokens"]["embedding"][tokens]


# --- training-time test -------------------------------------------------------------------------------------


def ttt_logits(head_params, cfg: Eagle3Config, target_params, target_cfg: ModelConfig, tokens: jax.Array,
               features: jax.Array, steps: int) -> list[jax.Array]:
    """Head logits of unroll steps 0..steps-1: entry k is [B, T, V], at target position t predicting the target's
    distribution at t + 1 + k (the token x_{t+k+2}). Step k >= 1 reads x_{t+1+k} with the head's own step k - 1
    output as its feature (training-time test: the features it will see when drafting), and attends to the step-0
    entries of positions <= t plus its own steps 1..k at t, exactly what chain drafting from t sees.

    tokens [B, T] (x_0..x_{T-1}); features [B, T, 3d] (the target's taps at each position). Written out on the
    params (no cache, each step's keys computed once) because training runs it at every step; a test checks it
    against the drafting path."""
    lc = cfg.layer
    p = head_params
    a = p["self_attn"]
    b, t = tokens.shape
    h, kvh, hd, eps = lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.rms_norm_eps
    inv_freq = jnp.asarray(rope_inv_freq(lc))
    causal = jnp.tril(jnp.ones((t, t), bool))
    hidden = linear(p["fc"], features)
    keys: list[tuple[jax.Array, jax.Array]] = []  # per step: (k, v) [B, T, H, hd] (GQA repeated)
    logits = []
    for j in range(steps):
        ids = tokens[:, np.minimum(np.arange(t) + 1 + j, t - 1)]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 1 + j, (b, t))
        x = jnp.concatenate([rms_norm(embed(target_params, ids), p["input_layernorm"]["scale"], eps),
                             rms_norm(hidden, p["hidden_norm"]["scale"], eps)], axis=-1)
        q = linear(a["q_proj"], x).reshape(b, t, h, hd)
        k = linear(a["k_proj"], x).reshape(b, t, kvh, hd)
        v = linear(a["v_proj"], x).reshape(b, t, kvh, hd)
        if lc.qk_norm:
            q, k = rms_norm(q, a["q_norm"]["scale"], eps), rms_norm(k, a["k_norm"]["scale"], eps)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)
        keys.append((k, v))
        scale = hd ** -0.5
        s0 = jnp.einsum("bthd,bshd->bhts", q, keys[0][0]) * scale
        s0 = jnp.where(causal, s0, -jnp.inf)
        diag = [jnp.einsum("bthd,bthd->bht", q, kk)[..., None] * scale for kk, _ in keys[1:]]
        weights = jax.nn.softmax(jnp.concatenate([s0, *diag], axis=-1), axis=-1)
        o = jnp.einsum("bhts,bshd->bthd", weights[..., :t], keys[0][1])
        for i, (_, vv) in enumerate(keys[1:]):
            o = o + weights[..., t + i].transpose(0, 2, 1)[..., None] * vv
        residual = hidden + linear(a["o_proj"], o.reshape(b, t, h * hd))
        m = p["mlp"]
        y = rms_norm(residual, p["post_attention_layernorm"]["scale"], eps)
        out = residual + linear(m["down_proj"], jax.nn.silu(linear(m["gate_proj"], y)) * linear(m["up_proj"], y))
        logits.append(lm_head(target_params, target_cfg, rms_norm(out, p["norm"]["scale"], eps)))
        hidden = out
    return logits


# --- save / load --------------------------------------------------------------------------------------------


def save_eagle3(head: Eagle3, path: str | Path, overwrite: bool = False) -> Path:
    """Write a head as `eagle3.json` + Orbax `params/`."""
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    path.mkdir(parents=True, exist_ok=True)
    (path / HEAD_CONFIG_FILE).write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / HEAD_PARAMS_DIR, head.params, force=True)
    return path


def load_eagle3(path: str | Path, target) -> Eagle3:
    """A head saved by `save_eagle3` / `parse-jax train-eagle3`, checked against `target`: a head trained for another
    target (hidden size, layer count, vocabulary) is a clear error, not silently wrong drafts. A target loaded in
    another dtype gets the head cast to it; a sharded target gets it replicated on its mesh."""
    path = Path(path)
    cfg_file = path / HEAD_CONFIG_FILE
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not an EAGLE-3 head folder (no {HEAD_CONFIG_FILE})")
    try:
        cfg = Eagle3Config.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    stored_dtype = cfg.layer.dtype
    if stored_dtype != target.config.dtype:  # e.g. --dtype bfloat16: follow the target
        cfg = dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=target.config.dtype))
    cfg.check_target(target.config)
    stored = dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=stored_dtype))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, jax.eval_shape(lambda: init_head(stored)))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore((path / HEAD_PARAMS_DIR).absolute(), abstract)
    except Exception as e:  # Orbax/TensorStore raise many types for damaged data
        raise CheckpointError(f"cannot restore the EAGLE-3 head params in {path / HEAD_PARAMS_DIR}: {e}") from None
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params)):
        raise CheckpointError(f"the EAGLE-3 head in {path} has NaN or infinite weights")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(cfg.layer.dtype)), params)  # on device once
    mesh = target.mesh
    if mesh is not None:  # the head runs beside the sharded target: whole on every device
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    return Eagle3(cfg, params)


@functools.cache
def head_module(cfg: Eagle3Config, attention_impl: str) -> Eagle3Head:
    return Eagle3Head(cfg.layer, attention_impl)


# --- chain drafting and verification (one jitted program) ----------------------------------------------------


@struct.dataclass
class EagleState:
    target_cache: KVCache
    head_cache: KVCache      # one entry per committed target position (same lengths as the target's)
    h_last: jax.Array        # [B, d] head output at the last committed position: drafts the token after `last`
    logits_last: jax.Array   # [B, V] its logits
    tokens: jax.Array        # [B, width] emitted ids
    num_new: jax.Array
    done: jax.Array
    last: jax.Array          # [B] last emitted token, not yet in the target's cache
    rounds: jax.Array        # target passes
    accepted: jax.Array      # [B] drafted tokens accepted
    proposed: jax.Array      # [B] drafted tokens proposed


def tree_leaves(props: jax.Array, head_logits: jax.Array, num_leaves: int) -> tuple[jax.Array, jax.Array]:
    """EAGLE-2's dynamic expansion, restricted to siblings of the chain: a node replacing proposal i by token c has
    confidence prod_{j<i} p_j(props_j) * p_i(c) under the head; the `num_leaves` most confident become leaves.
    Returns (depth [B, M] = i, token [B, M])."""
    b, gamma, v = head_logits.shape
    p = jax.nn.softmax(head_logits.astype(jnp.float32), axis=-1)
    p_chain = jnp.take_along_axis(p, props[..., None], -1)[..., 0]
    prefix = jnp.cumprod(jnp.concatenate([jnp.ones((b, 1)), p_chain[:, :-1]], axis=1), axis=1)
    conf = prefix[..., None] * p
    conf = jnp.where(jax.nn.one_hot(props, v, dtype=bool), -1.0, conf)  # the chain's own tokens are not leaves
    _, flat = jax.lax.top_k(conf.reshape(b, gamma * v), num_leaves)
    return (flat // v).astype(jnp.int32), (flat % v).astype(jnp.int32)


def tree_block(trunk: jax.Array, leaf_depth: jax.Array, leaf_tok: jax.Array, start: jax.Array):
    """The tree as a set of prefixes (docs/design.md §2): the chain [last, d_1..d_gamma] is group 0 (causal), leaf
    m (replacing d_{i+1}) is group m + 1, sees the chain up to d_i and sits at RoPE position start + i + 1."""
    b, g1 = trunk.shape
    m = leaf_tok.shape[1]
    block = jnp.concatenate([trunk, leaf_tok], axis=1)
    chain_pos = jnp.arange(g1, dtype=jnp.int32)[None]
    pos = start + jnp.concatenate([jnp.broadcast_to(chain_pos, (b, g1)), leaf_depth + 1], axis=1)
    limit = jnp.concatenate([jnp.broadcast_to(chain_pos + 1, (b, g1)), leaf_depth + 1], axis=1)
    group = jnp.concatenate([jnp.zeros((b, g1), jnp.int32),
                             jnp.broadcast_to(jnp.arange(1, m + 1, dtype=jnp.int32)[None], (b, m))], axis=1)
    return block, pos, limit, group


def move_kv(cache: KVCache, src: jax.Array, dst: jax.Array, where: jax.Array) -> KVCache:
    """Copy each row's KV entry at slot `src` to slot `dst` where `where` (an accepted leaf takes the place of the
    rejected chain token); the entry was computed at the right RoPE position, so nothing is recomputed."""
    rows = jnp.arange(cache.batch)
    src = jnp.clip(src, 0, cache.max_len - 1)
    dst = jnp.where(where, jnp.clip(dst, 0, cache.max_len - 1), cache.max_len)  # out of range: dropped

    def move(buf):
        return buf.at[rows, :, dst].set(buf[rows, :, src], mode="drop")

    return cache.replace(k=tuple(move(x) for x in cache.k), v=tuple(move(x) for x in cache.v))


class EagleFns(NamedTuple):
    """The functions an EAGLE-3 loop calls inside a jit (`head_applies`): the target with its taps, the head, and
    the target's LM head."""

    target: Callable
    head: Callable
    lm: Callable


@struct.dataclass
class EagleContext:
    """What the target has read before the loop starts: its tokens [B, L] and taps [B, L, 3d], how many count per
    row [B], and the target's next-token logits after them [B, V]."""

    tokens: jax.Array
    features: jax.Array
    length: jax.Array
    first_logits: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleLoop:
    """The static settings of an EAGLE-3 drafting loop (one program per value)."""

    config: Eagle3Config
    gamma: int
    num_new: int
    tree: int = 0          # sibling leaves per round (greedy only)
    first_pass: int = 0    # target passes already made: 1 after a prefill, 0 from a PARSE boundary


def eagle_loop(fns: EagleFns, target_cache: KVCache, ctx: EagleContext, *, loop: EagleLoop, max_new: jax.Array,
               eos_ids: jax.Array, sampler: Sampler, args: SamplingArgs):
    """From a target cache holding `ctx.length` context tokens and the target's taps at those positions: emit the
    first token from `ctx.first_logits`, fill the head's cache, then rounds of (gamma head steps -> one target pass
    -> lossless acceptance) until every row is done. `loop.tree` > 0 (greedy only): the chain plus that many sibling
    leaves picked by draft confidence, verified in the same target pass (`tree_block`)."""
    target_fwd, head_apply, lm = fns
    gamma, num_new, tree = loop.gamma, loop.num_new, loop.tree
    first_logits, ctx_tokens, ctx_feats, n = ctx.first_logits, ctx.tokens, ctx.features, ctx.length
    head_cache = KVCache.init(loop.config.layer, first_logits.shape[0], target_cache.max_len)
    b = first_logits.shape[0]
    rows = jnp.arange(b)
    width = num_new + gamma + 1
    first = sampler.sample(first_logits, args.fold(2**31 - 1))
    # the head's entry for position t reads x_{t+1}: the context shifted by one, then the first emitted token
    shifted = jnp.concatenate([ctx_tokens[:, 1:], ctx_tokens[:, :1]], axis=1)
    shifted = shifted.at[rows, n - 1].set(first)
    length = ctx_tokens.shape[1]
    limit, group = causal_metadata(b, length)
    positions = jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32), (b, length))
    out, normed, head_cache = head_apply(shifted, ctx_feats, True, positions, head_cache, limit, group)
    head_cache = head_cache.commit(n)
    done = (max_new <= 0) | jnp.any(first[:, None] == eos_ids[None, :], -1) | (max_new <= 1)
    tokens = jnp.full((b, width), PAD_ID, jnp.int32).at[:, 0].set(jnp.where(max_new > 0, first, PAD_ID))
    state = EagleState(target_cache=target_cache, head_cache=head_cache, h_last=out[rows, n - 1],
                       logits_last=lm(normed[rows, n - 1]), tokens=tokens, num_new=jnp.minimum(max_new, 1),
                       done=done, last=first, rounds=jnp.int32(loop.first_pass), accepted=jnp.zeros((b,), jnp.int32),
                       proposed=jnp.zeros((b,), jnp.int32))
    one_limit, one_group = causal_metadata(b, 1)

    def draft_chain(state: EagleState, a_draft: SamplingArgs):
        """gamma proposals: the first from `logits_last`, then gamma - 1 head steps on the head's own outputs.
        Returns (props [B, gamma], q [B, gamma, V] the distributions they were drawn from, head logits)."""
        q1 = sampler.probs(state.logits_last, args)
        d1 = sampler.sample(state.logits_last, a_draft.fold(0))
        if gamma == 1:
            return d1[:, None], q1[:, None], state.logits_last[:, None]
        base = state.head_cache.lengths

        def step(carry, k):
            cache, tok, hidden = carry
            out, normed, cache = head_apply(tok[:, None], hidden[:, None], False, (base + k)[:, None], cache,
                                            one_limit, one_group)
            cache = cache.commit(1)
            logits = lm(normed[:, 0])
            nxt = sampler.sample(logits, a_draft.fold(k))
            return (cache, nxt, out[:, 0]), (nxt, sampler.probs(logits, args), logits)

        _, (rest, qs, ls) = jax.lax.scan(step, (state.head_cache, d1, state.h_last), jnp.arange(1, gamma))
        props = jnp.concatenate([d1[:, None], rest.T], axis=1)
        q = jnp.concatenate([q1[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        return props, q, jnp.concatenate([state.logits_last[:, None], jnp.swapaxes(ls, 0, 1)], axis=1)

    def cond(state: EagleState):
        return ~jnp.all(state.done)

    def body(state: EagleState):
        a_draft, a_accept, a_fix = args.fold(state.rounds).split(3)
        props, q, head_logits = draft_chain(state, a_draft)
        trunk = jnp.concatenate([state.last[:, None], props], axis=1)  # [B, gamma + 1]
        start = state.target_cache.lengths[:, None]
        if tree:
            leaf_depth, leaf_tok = tree_leaves(props, head_logits, tree)
            block, pos, blk_limit, blk_group = tree_block(trunk, leaf_depth, leaf_tok, start)
        else:
            block = trunk
            blk_limit, blk_group = causal_metadata(b, gamma + 1)
            pos = start + jnp.arange(gamma + 1, dtype=jnp.int32)[None]
        logits, t_cache, feats = target_fwd(block, pos, state.target_cache, blk_limit, blk_group)
        p = sampler.probs(logits[:, : gamma + 1], args)
        n_acc, emitted = accept_proposals(p, q, props, sampler, a_accept.key, a_fix.key)
        path = jnp.broadcast_to(jnp.arange(gamma + 1 + bool(tree), dtype=jnp.int32), (b, gamma + 1 + bool(tree)))
        if tree:  # greedy: a leaf at the first rejected depth that equals the target's token is accepted too
            hit = ((leaf_depth == n_acc[:, None]) & (leaf_tok == emitted[rows, n_acc][:, None])
                   & (n_acc < gamma)[:, None])
            leaf_ok = hit.any(axis=1)
            leaf_at = gamma + 1 + jnp.argmax(hit, axis=1)  # its block index
            bonus = jnp.argmax(logits[rows, leaf_at], axis=-1).astype(jnp.int32)
            emitted = jnp.concatenate([emitted, jnp.full((b, 1), PAD_ID, jnp.int32)], axis=1)
            emitted = emitted.at[rows, n_acc + 1].set(jnp.where(leaf_ok, bonus, emitted[rows, n_acc + 1]))
            path = path.at[rows, n_acc + 1].set(jnp.where(leaf_ok, leaf_at, n_acc + 1))
            t_cache = move_kv(t_cache, start[:, 0] + leaf_at, start[:, 0] + n_acc + 1, leaf_ok)
            n_acc = n_acc + leaf_ok.astype(jnp.int32)
            feats = jnp.take_along_axis(feats, path[..., None], axis=1)
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
            accepted=state.accepted + n_acc * live, proposed=state.proposed + (gamma + tree) * live)

    return jax.lax.while_loop(cond, body, state)


def head_applies(target_cfg: ModelConfig, cfg: Eagle3Config, impl: str, target_params, head_params):
    target = Decoder(target_cfg, impl)
    head = head_module(cfg, impl)

    forward = forward_fn(target, target_params, return_hidden=True)

    def target_fwd(tokens, positions, cache, limit, group):
        logits, cache, hiddens = forward(tokens, positions, cache, limit, group)
        return logits, cache, target_taps(hiddens, cfg.taps)

    def head_apply(tokens, hidden, fuse: bool, positions, cache, limit, group):
        if fuse:
            hidden = head.apply({"params": head_params}, hidden, method=Eagle3Head.fuse)
        return head.apply({"params": head_params}, embed(target_params, tokens), hidden, positions, cache, limit,
                          group)

    def lm(normed):
        return lm_head(target_params, target_cfg, normed)

    return EagleFns(target_fwd, head_apply, lm)


@functools.cache
def generate_program(target_cfg: ModelConfig, impl: str, cache_len: int, loop: EagleLoop, sampler: Sampler):
    """Target + EAGLE-3 from prompts: one target prefill (with feature taps), then `eagle_loop`."""
    num_new = loop.num_new

    def run(target_params, head_params, prompt, prompt_lens, max_new, eos_ids, args: SamplingArgs):
        fns = head_applies(target_cfg, loop.config, impl, target_params, head_params)
        b, p = prompt.shape
        limit, group = causal_metadata(b, p)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        logits, t_cache, feats = fns.target(prompt, positions, KVCache.init(target_cfg, b, cache_len), limit, group)
        ctx = EagleContext(tokens=prompt, features=feats, length=prompt_lens,
                           first_logits=logits[jnp.arange(b), prompt_lens - 1])
        state = eagle_loop(fns, t_cache.commit(prompt_lens), ctx, loop=loop, max_new=max_new, eos_ids=eos_ids,
                           sampler=sampler, args=args)
        return state.tokens[:, :num_new], state.num_new, state.rounds, state.accepted, state.proposed

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
                    max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int = 0, add_bos: bool = True, eos_ids: Sequence[int] | None = None,
                    tree: int = 0) -> GenerateResult:
    """Target + EAGLE-3 drafting, lossless: greedy output equals the target's; sampled output follows the target's
    distribution (rejection sampling against the head's distribution). `tree` > 0: the chain of `gamma` plus that
    many sibling leaves chosen by draft confidence, all verified in one target pass (greedy only)."""
    head.config.check_target(target.config)
    check_tree(tree, temperature)
    if int(gamma) < 1:
        raise InputError(f"gamma (draft tokens per round) must be >= 1, got {gamma}")
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    req = spec_request(target, prompts, max_new_tokens, sampling, add_bos, eos_ids)
    return eagle3_speculate(target, head, req, gamma=int(gamma), tree=int(tree))


def eagle3_speculate(target, head: Eagle3, req: Request, *, gamma: int, tree: int = 0) -> GenerateResult:
    """EAGLE-3 drafting of a validated request (mode `eagle3`)."""
    program, sb = eagle3_launch(target, head, req, gamma=gamma, tree=tree)
    res = run_spec(target, program, head.params, sb, gamma)
    res.stats["tree"] = tree
    return res


def eagle3_launch(target, head: Eagle3, req: Request, *, gamma: int, tree: int = 0):
    """(program, prepared batch) of EAGLE-3 drafting for `req`, not run (`draft_model.spec_args` gives its
    arguments)."""
    sb = spec_batch(target, req, gamma=gamma, capacity=target.config.max_position_embeddings, extra_slots=tree)
    loop = EagleLoop(config=head.config, gamma=gamma, num_new=sb.num_new, tree=tree, first_pass=1)
    return generate_program(target.config, target.attention_impl, sb.cache_len, loop, sb.sampling.sampler), sb


def check_tree(tree: int, temperature: float) -> None:
    if int(tree) < 0:
        raise ConfigError(f"tree (sibling leaves per round) must be >= 0, got {tree}")
    if tree and temperature > 0:
        raise ConfigError("EAGLE-3 tree drafting is greedy only (temperature 0); use the chain (tree=0) to sample")

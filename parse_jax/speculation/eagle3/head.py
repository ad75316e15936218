"""The EAGLE-3 head: a one-layer draft model that reads the target's own hidden states.

The head (Li et al., EAGLE-3, 2025) fuses the target's hidden states from a few layers (`fc`: n*d -> d over the
concatenated taps), then runs ONE decoder layer whose attention input is [norm(token embedding) ; norm(feature)]
(2d wide). Its output hidden state is fed back as the next step's feature, so it drafts several tokens per target
pass. Its vocabulary is either the target's (the head shares the target's embedding and LM head, as heads trained
here by default do) or a smaller draft vocabulary with its own LM head (`lm_head` over `draft_vocab` ids, mapped to
target ids through `d2t`), as the published heads ship it; a head may also bring its own embedding table.

Positions: the head's entry for target position t reads token x_{t+1} and the target's features at t, and sits at
RoPE position t + 1; its k-th own step from t reads the k-th drafted token at position t + 1 + k. Training-time
test (`ttt_logits`) unrolls exactly that: step k at t sees the step-0 entries of positions <= t and its own
steps 1..k at t, which is what chain drafting from t sees through the KV cache; the two agree to float32
rounding (tested), and both agree with the `speculators` package's PyTorch model on its own heads (tested).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import ConfigError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import MASKED_LOGIT, ModelConfig, rope_attention_scaling, rope_inv_freq
from parse_jax.models.decoder import MLP, Attention, RMSNorm, apply_rope
from parse_jax.models.functional import linear, rms_norm

# params beside the decoder layer's: a draft vocabulary's LM head and its ids, the head's own embedding table
EXTRA_PARAMS = ("lm_head", "d2t", "embed_tokens")


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """The taps of heads trained here: EAGLE-3's low / middle / high layers (outputs of layers 2, L/2 and L-3), as
    indices into the decoder's `hiddens` (index i = the input of layer i = the output of layer i - 1, the layer ids
    speculators and vLLM call `eagle_aux_hidden_state_layer_ids`); a target of 5 layers or fewer gets them clamped
    and sorted, some repeated."""
    def clamp(i: int) -> int:
        return min(max(i, 1), num_layers)

    low, mid, high = sorted((clamp(3), clamp(num_layers // 2 + 1), clamp(num_layers - 2)))
    return low, mid, high


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's decoder layer (its `vocab_size` is the target's), the target layers it reads (`taps`) and what it
    was built for. `draft_vocab`: the size of its own LM head's vocabulary (None: it uses the target's LM head);
    `own_embed`: it has its own embedding table (else the target's); `norm_before_residual` / `norm_output`: the
    speculators variants (the residual starts from the normed feature / the fed-back state is the normed one).
    `target_layers`: the target's depth when known (heads trained here record it; published heads do not)."""

    layer: ModelConfig
    taps: tuple[int, ...]
    target_layers: int | None
    draft_vocab: int | None = None
    own_embed: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, taps: tuple[int, ...] | None = None,
                   draft_vocab: int | None = None) -> Eagle3Config:
        taps = tuple(taps) if taps is not None else default_taps(target_cfg.num_layers)
        cfg = cls(layer=target_cfg.replace(num_layers=1), taps=taps, target_layers=target_cfg.num_layers,
                  draft_vocab=draft_vocab)
        cfg.check_target(target_cfg)
        return cfg

    def check_target(self, target_cfg: ModelConfig) -> None:
        """A head reads one target's hidden states and proposes its token ids: refuse any other, naming the field."""
        problems = []
        for name in ("hidden_size", "vocab_size", "dtype"):
            mine, theirs = getattr(self.layer, name), getattr(target_cfg, name)
            if mine != theirs:
                problems.append(f"{name}: head {mine}, target {theirs}")
        if self.target_layers is not None and self.target_layers != target_cfg.num_layers:
            problems.append(f"num_layers: head built for {self.target_layers}, target has {target_cfg.num_layers}")
        if not self.taps or not all(0 <= t <= target_cfg.num_layers for t in self.taps):
            problems.append(f"taps (eagle_aux_hidden_state_layer_ids) {list(self.taps)} must be layer ids in "
                            f"[0, {target_cfg.num_layers}]")
        if self.draft_vocab is not None and not 1 <= self.draft_vocab <= target_cfg.vocab_size:
            problems.append(f"draft_vocab_size: {self.draft_vocab}, allowed 1..{target_cfg.vocab_size}")
        if problems:
            raise ConfigError("this EAGLE-3 head was trained for another target: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer.to_dict(), "taps": list(self.taps), "target_layers": self.target_layers,
                "draft_vocab": self.draft_vocab, "own_embed": self.own_embed,
                "norm_before_residual": self.norm_before_residual, "norm_output": self.norm_output}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        try:
            layers = d["target_layers"]
            vocab = d.get("draft_vocab")
            return cls(layer=ModelConfig.from_dict(d["layer"]), taps=tuple(int(t) for t in d["taps"]),
                       target_layers=None if layers is None else int(layers),
                       draft_vocab=None if vocab is None else int(vocab), own_embed=bool(d.get("own_embed", False)),
                       norm_before_residual=bool(d.get("norm_before_residual", False)),
                       norm_output=bool(d.get("norm_output", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed EAGLE-3 head config: {type(e).__name__}: {e}") from None


class Eagle3Head(nn.Module):
    """`fuse(features [B,T,n*d]) -> [B,T,d]`; `__call__(embeds, hidden, ...) -> (out, normed, cache)`.

    `hidden` is the fused target feature (step 0) or the head's own previous `out` (later steps); `normed`
    goes through the LM head."""

    cfg: ModelConfig
    attention_impl: str = "xla"
    norm_before_residual: bool = False
    norm_output: bool = False

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
        normed_hidden = self.hidden_norm(hidden)
        x = jnp.concatenate([self.input_layernorm(embeds), normed_hidden], axis=-1)
        h, k, v = self.self_attn(x, positions, cache.k[0], cache.v[0], cache.lengths, limit, group)
        residual = (normed_hidden if self.norm_before_residual else hidden) + h
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        normed = self.norm(out)
        return (normed if self.norm_output else out), normed, cache.replace(k=(k,), v=(v,))

    def init_all(self, embeds, features, positions, cache, limit, group):
        return self(embeds, self.fuse(features), positions, cache, limit, group)


@dataclasses.dataclass
class Eagle3:
    """A head: its config and params. `pj.load_eagle3(path, target)` returns one (any of the layouts it reads);
    it runs with its target's `attention_impl`."""

    config: Eagle3Config
    params: dict[str, Any]

    def __repr__(self) -> str:
        c = self.config
        vocab = f", draft_vocab={c.draft_vocab}" if c.draft_vocab is not None else ""
        return f"Eagle3(hidden={c.layer.hidden_size}, taps={c.taps}{vocab})"

    def for_target(self, target_cfg: ModelConfig) -> Eagle3:
        """The head as it meets a target: checked against it (`Eagle3Config.check_target`) and in its dtype, as
        `load_eagle3(path, target)` loads it (a head loaded alone keeps its stored dtype; a bfloat16 target runs it
        in bfloat16)."""
        cfg = dataclasses.replace(self.config, layer=self.config.layer.replace(dtype=target_cfg.dtype))
        cfg.check_target(target_cfg)
        if cfg == self.config:
            return self
        dtype = jnp.dtype(target_cfg.dtype)
        return Eagle3(cfg, jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                        self.params))


def check_head(name: str, value) -> Eagle3:
    """`value` as an EAGLE-3 head: a model, None or a path given where a head is asked for is one clear error."""
    if not isinstance(value, Eagle3):
        raise ConfigError(f"{name} must be an EAGLE-3 head (pj.load_eagle3; `parse-jax train-eagle3` trains one), "
                          f"got {type(value).__name__}")
    return value


@functools.cache
def head_module(cfg: Eagle3Config, attention_impl: str) -> Eagle3Head:
    return Eagle3Head(cfg.layer, attention_impl, cfg.norm_before_residual, cfg.norm_output)


def init_head(cfg: Eagle3Config, seed: int = 0) -> dict[str, Any]:
    """Random params (normal, std 0.02) of the head's layer, in its dtype (no LM head / vocabulary / embedding:
    `abstract_params` adds their shapes)."""
    d = cfg.layer.hidden_size
    module = head_module(cfg, "xla")
    dtype = jnp.dtype(cfg.layer.dtype)
    embeds = jnp.zeros((1, 1, d), dtype)
    feats = jnp.zeros((1, 1, len(cfg.taps) * d), dtype)
    cache = KVCache.init(cfg.layer, 1, 1)
    one = jnp.ones((1, 1), jnp.int32)
    init = jax.jit(lambda key: module.init(key, embeds, feats, one, cache, one, one * 0,
                                           method=Eagle3Head.init_all)["params"])
    return init(jax.random.PRNGKey(seed))


def abstract_params(cfg: Eagle3Config) -> dict[str, Any]:
    """Shapes and dtypes of every param a head of `cfg` has (what a restore or a published layout must fill)."""
    tree = dict(jax.eval_shape(lambda: init_head(cfg)))
    d, dtype = cfg.layer.hidden_size, jnp.dtype(cfg.layer.dtype)
    if cfg.draft_vocab is not None:
        tree["lm_head"] = {"kernel": jax.ShapeDtypeStruct((d, cfg.draft_vocab), dtype)}
        tree["d2t"] = jax.ShapeDtypeStruct((cfg.draft_vocab,), jnp.int32)
    if cfg.own_embed:
        tree["embed_tokens"] = {"embedding": jax.ShapeDtypeStruct((cfg.layer.vocab_size, d), dtype)}
    return tree


def layer_params(head_params: dict[str, Any]) -> dict[str, Any]:
    """The decoder layer's params (what `Eagle3Head.apply` takes)."""
    return {k: v for k, v in head_params.items() if k not in EXTRA_PARAMS}


def target_taps(hiddens: tuple[jax.Array, ...], taps: tuple[int, ...]) -> jax.Array:
    """[B, T, n*d]: the tapped hidden states of a decoder pass run with `return_hidden`."""
    return jnp.concatenate([hiddens[i] for i in taps], axis=-1)


def lm_head(target_params, target_cfg: ModelConfig, normed: jax.Array) -> jax.Array:
    """The target's own output projection: float32 logits, padded vocabulary rows masked as the decoder masks
    them."""
    if target_cfg.tie_word_embeddings:
        w = target_params["embed_tokens"]["embedding"]
        logits = jnp.einsum("...d,vd->...v", normed, w).astype(jnp.float32)
    else:
        logits = (normed @ target_params["lm_head"]["kernel"]).astype(jnp.float32)
    if target_cfg.vocab_limit is not None and target_cfg.vocab_limit < target_cfg.vocab_size:
        logits = jnp.where(jnp.arange(target_cfg.vocab_size) < target_cfg.vocab_limit, logits, MASKED_LOGIT)
    return logits


def draft_logits(head_params, target_params, target_cfg: ModelConfig, normed: jax.Array) -> jax.Array:
    """float32 logits over the head's vocabulary: its own LM head's (draft ids) or, without one, the target's."""
    if "lm_head" in head_params:
        return (normed @ head_params["lm_head"]["kernel"]).astype(jnp.float32)
    return lm_head(target_params, target_cfg, normed)


def to_target_vocab(head_params, logits: jax.Array, vocab_size: int) -> jax.Array:
    """Draft-vocabulary logits [..., Vd] placed at their target ids (`d2t`) of a [..., V] row, every other id
    masked: a token outside the draft vocabulary is never proposed. Target-vocabulary logits pass as they are."""
    if "d2t" not in head_params:
        return logits
    full = jnp.full(logits.shape[:-1] + (vocab_size,), MASKED_LOGIT, logits.dtype)
    return full.at[..., head_params["d2t"]].set(logits)


def embed(head_params, target_params, tokens: jax.Array) -> jax.Array:
    """Token embeddings: the head's own table when it has one, else the target's."""
    table = head_params["embed_tokens"] if "embed_tokens" in head_params else target_params["embed_tokens"]
    return table["embedding"][tokens]


def check_vocab_map(d2t: np.ndarray, vocab_size: int, where: str) -> None:
    """A draft vocabulary's target ids: distinct, in [0, vocab_size)."""
    if d2t.ndim != 1 or len(d2t) == 0:
        raise ConfigError(f"{where}: d2t must be a non-empty 1-D map, got shape {d2t.shape}")
    if d2t.min() < 0 or d2t.max() >= vocab_size:
        raise ConfigError(f"{where}: d2t maps draft ids to target ids {int(d2t.min())}..{int(d2t.max())}, "
                          f"allowed 0..{vocab_size - 1} (the target's vocab_size {vocab_size})")
    if len(np.unique(d2t)) != len(d2t):
        raise ConfigError(f"{where}: d2t maps two draft ids to the same target id")


# --- training-time test -------------------------------------------------------------------------------------


def ttt_logits(head_params, cfg: Eagle3Config, target_params, target_cfg: ModelConfig, tokens: jax.Array,
               features: jax.Array, steps: int) -> list[jax.Array]:
    """Head logits of unroll steps 0..steps-1 over the head's vocabulary (`draft_logits`): entry k is [B, T, V],
    at target position t predicting the target's distribution at t + 1 + k (the token x_{t+k+2}). Step k >= 1
    reads x_{t+1+k} with the head's own step k - 1 output as its feature (training-time test: the features it will
    see when drafting), and attends to the step-0 entries of positions <= t plus its own steps 1..k at t, exactly
    what chain drafting from t sees (and what speculators' `Eagle3DraftModel.forward` computes).

    tokens [B, T] (x_0..x_{T-1}); features [B, T, n*d] (the target's taps at each position). Written out on the
    params (no cache, each step's keys computed once) because training runs it at every step; a test checks it
    against the drafting path."""
    lc = cfg.layer
    p = head_params
    a = p["self_attn"]
    b, t = tokens.shape
    h, kvh, hd, eps = lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.rms_norm_eps
    inv_freq, rope_scale = jnp.asarray(rope_inv_freq(lc)), rope_attention_scaling(lc)
    causal = jnp.tril(jnp.ones((t, t), bool))
    hidden = linear(p["fc"], features)
    keys: list[tuple[jax.Array, jax.Array]] = []  # per step: (k, v) [B, T, H, hd] (GQA repeated)
    logits = []
    for j in range(steps):
        ids = tokens[:, np.minimum(np.arange(t) + 1 + j, t - 1)]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 1 + j, (b, t))
        normed_hidden = rms_norm(hidden, p["hidden_norm"]["scale"], eps)
        x = jnp.concatenate([rms_norm(embed(p, target_params, ids), p["input_layernorm"]["scale"], eps),
                             normed_hidden], axis=-1)
        q = linear(a["q_proj"], x).reshape(b, t, h, hd)
        k = linear(a["k_proj"], x).reshape(b, t, kvh, hd)
        v = linear(a["v_proj"], x).reshape(b, t, kvh, hd)
        if lc.qk_norm:
            q, k = rms_norm(q, a["q_norm"]["scale"], eps), rms_norm(k, a["k_norm"]["scale"], eps)
        q, k = apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale)
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
        start = normed_hidden if cfg.norm_before_residual else hidden
        residual = start + linear(a["o_proj"], o.reshape(b, t, h * hd))
        m = p["mlp"]
        y = rms_norm(residual, p["post_attention_layernorm"]["scale"], eps)
        out = residual + linear(m["down_proj"], jax.nn.silu(linear(m["gate_proj"], y)) * linear(m["up_proj"], y))
        normed = rms_norm(out, p["norm"]["scale"], eps)
        logits.append(draft_logits(p, target_params, target_cfg, normed))
        hidden = normed if cfg.norm_output else out
    return logits

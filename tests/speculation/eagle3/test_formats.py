"""Published EAGLE-3 heads (tests/fixtures/eagle3, written by the speculators package's own classes): the layouts
are detected, the draft logits equal speculators' PyTorch model's, greedy decoding with them (a draft vocabulary
smaller than the target's) is token-identical to the target alone, mismatching heads are refused by field."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from parse_jax.errors import CheckpointError, ConfigError
from parse_jax.models.cache import KVCache
from parse_jax.models.config import MASKED_LOGIT
from parse_jax.models.decoder import causal_metadata
from parse_jax.models.model import Model
from parse_jax.runtime.decode import generate
from parse_jax.speculation.eagle3 import eagle3_generate, head_applies, head_layout, load_eagle3, ttt_logits
from tests.random_models import random_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "eagle3"
LAYOUTS = ("original", "speculators")
TARGET_LAYERS = 8  # fixtures/eagle3/target/config.json


def fixture_target(seed: int = 0, **overrides) -> Model:
    """A Flax Qwen3 target of the fixture's shape whose embedding is the fixture target's (the original release
    ships no embedding of its own: the head reads the target's)."""
    t = random_model("qwen3", seed, num_layers=TARGET_LAYERS, **overrides)
    table = safetensors.numpy.load_file(FIXTURES / "target" / "model.safetensors")["model.embed_tokens.weight"]
    params = {**t.params, "embed_tokens": {"embedding": jnp.asarray(table)}}
    return Model(t.config, params, t.tokenizer)


def reference(layout: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "reference.npz") as z:
        return {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(layout + "/")}


def test_the_layouts_are_detected(tmp_path):
    assert head_layout(FIXTURES / "original") == "eagle3-release"
    assert head_layout(FIXTURES / "speculators") == "speculators"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head folder"):
        head_layout(tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_logits_equal_the_speculators_model(layout):
    """speculators' forward (training-time test, 3 steps) on fixed hidden states and tokens, against ttt_logits and
    the drafting path: float32, max |diff| <= 1e-4."""
    target = fixture_target()
    head = load_eagle3(FIXTURES / layout, target)
    ref = reference(layout)
    ids, hidden, want = ref["input_ids"], ref["hidden"], ref["logits"]  # want [steps, T, draft_vocab]
    steps, t = want.shape[:2]
    assert head.config.draft_vocab == want.shape[-1] < target.config.vocab_size
    assert head.config.taps == ((2, 4, 5) if layout == "original" else (1, 2, 8))
    # speculators' input_ids[t] is the token after position t; ttt_logits reads tokens[t + 1] at t
    tokens = jnp.asarray(np.concatenate([ids[:, :1], ids], axis=1), jnp.int32)
    feats = jnp.asarray(np.concatenate([hidden, hidden[:, -1:]], axis=1))
    got = ttt_logits(head.params, head.config, target.params, target.config, tokens, feats, steps)
    for k in range(steps):
        diff = np.abs(np.asarray(got[k][0, : t - k]) - want[k, : t - k]).max()
        assert diff <= 1e-4, (layout, k, diff)
    # the drafting path (cache, fused features, logits placed at target ids through d2t) gives step 0 too
    _, head_apply, lm = head_applies(target.config, head.config, "xla", target.params, head.params)
    limit, group = causal_metadata(1, t)
    pos = jnp.arange(1, t + 1, dtype=jnp.int32)[None]
    _, normed, _ = head_apply(jnp.asarray(ids, jnp.int32), jnp.asarray(hidden), True, pos,
                              KVCache.init(head.config.layer, 1, t), limit, group)
    full = np.asarray(lm(normed))[0]
    d2t = np.asarray(head.params["d2t"])
    assert np.abs(full[:, d2t] - want[0]).max() <= 1e-4
    outside = np.setdiff1d(np.arange(target.config.vocab_size), d2t)
    assert (full[:, outside] == MASKED_LOGIT).all()  # a token outside the draft vocabulary is never proposed


@pytest.mark.parametrize("layout,gamma,tree,k", [("original", 3, 0, 1), ("speculators", 4, 0, 1),
                                                 ("original", 3, 5, 2), ("speculators", 4, 8, 3)])
def test_greedy_eagle3_with_a_published_head_is_token_identical(layout, gamma, tree, k):
    """Chains and trees (depth 3 and 4) with a draft vocabulary smaller than the target's."""
    target = fixture_target(seed=5)
    head = load_eagle3(FIXTURES / layout, target)
    rng = np.random.default_rng(gamma)
    prompts = [rng.integers(0, target.config.vocab_size, n).tolist() for n in (6, 11, 3)]
    expect = generate(target, prompts, max_new_tokens=16).tokens
    res = eagle3_generate(target, head, prompts, gamma=gamma, max_new_tokens=16, tree=tree, tree_top_k=k)
    assert res.tokens == expect
    assert res.stats["draft_tokens"] > 0


def test_a_tree_proposes_only_draft_vocabulary_tokens():
    """The tree's nodes come from the head's logits placed through d2t: every node in the tree is a draft id's."""
    from parse_jax.speculation.eagle3 import expand
    from parse_jax.speculation.eagle3.decode import _tree_step

    target = fixture_target(seed=5)
    head = load_eagle3(FIXTURES / "original", target)
    fns = head_applies(target.config, head.config, "xla", target.params, head.params)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, target.config.vocab_size, (2, 7)), jnp.int32)
    limit, group = causal_metadata(2, 7)
    pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    _, _, feats = fns.target(ids, pos, KVCache.init(target.config, 2, 7), limit, group)
    out, normed, cache = fns.head(ids, feats, True, pos + 1, KVCache.init(head.config.layer, 2, 64), limit, group)
    tree = expand(_tree_step(fns, cache.commit(7)), out[:, -1], fns.lm(normed[:, -1]), depth=3, k=4, nodes=30)
    toks = np.asarray(tree.token)[np.asarray(tree.valid)]
    assert len(toks) == 60 and np.isin(toks, np.asarray(head.params["d2t"])).all()


def test_parse_eagle3_with_a_published_head_is_token_identical():
    """parse+eagle3 through the engine (threshold 1: nothing accepted, so the continuation, EAGLE-3 with the
    published head and its draft vocabulary, writes every token) equals the target's greedy output."""
    from parse_jax.engine import ParseConfig, ParseEngine
    from parse_jax.models.tokenizer import Tokenizer
    from parse_jax.tasks import TOKENIZER_DIR

    tok = Tokenizer.from_folder(TOKENIZER_DIR)
    base = fixture_target(seed=7, vocab_limit=tok.vocab_size)
    target = Model(base.config, base.params, tok)
    d = random_model("llama3", 8, vocab_size=target.config.vocab_size, vocab_limit=tok.vocab_size)
    draft = Model(d.config, d.params, tok)
    head = load_eagle3(FIXTURES / "speculators", target)
    prompts = ["( 1 + 2 ) * ( 3 - 4 ) :", "( 7 * 8 ) - 9 :"]
    expect = generate(target, prompts, max_new_tokens=14).tokens
    for tree in ({}, {"eagle3_gamma": 3, "eagle3_tree": 6, "eagle3_tree_top_k": 2}):  # the chain, a depth-3 tree
        cfg = ParseConfig.from_flat(ParseConfig(max_draft_tokens=8, threshold=1.0), **tree)
        eng = ParseEngine(target, draft, cfg, eagle3=head)
        assert eng.generate(prompts, mode="eagle3", max_new_tokens=14).tokens == expect
        res = eng.generate(prompts, mode="parse+eagle3", max_new_tokens=14)
        assert res.tokens == expect and res.stats["eagle3_draft_tokens"] > 0


def _copy(layout: str, tmp_path: Path) -> Path:
    out = tmp_path / layout
    shutil.copytree(FIXTURES / layout, out)
    return out


def _edit_config(folder: Path, **changes) -> None:
    d = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        node = d
        *parents, leaf = key.split("/")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (folder / "config.json").write_text(json.dumps(d))


def test_a_head_for_another_target_is_refused_by_field(tmp_path):
    with pytest.raises(ConfigError, match="hidden_size: head 48, target 64"):
        load_eagle3(FIXTURES / "speculators", random_model("qwen3", 0, num_layers=8, hidden_size=64))
    with pytest.raises(ConfigError, match="vocab_size: head 103, target 90"):
        load_eagle3(FIXTURES / "original", random_model("qwen3", 0, num_layers=8, vocab_size=90))
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids\) \[1, 2, 8\].*\[0, 4\]"):
        load_eagle3(FIXTURES / "speculators", random_model("qwen3", 0, num_layers=4))
    with pytest.raises(ConfigError, match="default layers"):  # the release's taps (2, L//2, L-3) need L >= 6
        load_eagle3(FIXTURES / "original", random_model("qwen3", 0, num_layers=4))
    target = fixture_target()
    bad = _copy("speculators", tmp_path)
    _edit_config(bad, fc_norm=True)
    with pytest.raises(ConfigError, match="'fc_norm' is true"):
        load_eagle3(bad, target)
    _edit_config(bad, fc_norm=False, **{"transformer_layer_config/num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="'num_hidden_layers' is 2"):
        load_eagle3(bad, target)
    _edit_config(bad, **{"transformer_layer_config/num_hidden_layers": 1, "transformer_layer_config/head_dim": 8})
    with pytest.raises(CheckpointError, match=r"'layers.0.self_attn.k_norm.weight' has shape \[16\], the config"):
        load_eagle3(bad, target)
    cut = _copy("original", tmp_path)
    weights = safetensors.numpy.load_file(cut / "model.safetensors")
    weights["d2t"][3] += 200  # a draft id mapped past the target's vocabulary
    safetensors.numpy.save_file(weights, cut / "model.safetensors")
    with pytest.raises(ConfigError, match="d2t maps draft ids to target ids"):
        load_eagle3(cut, target)


def _random_draft_vocab_head(target, draft_vocab: int, seed: int):
    """A head trained here with a draft vocabulary: its own LM head (the target's rows for `d2t`)."""
    import jax

    from parse_jax.speculation.eagle3 import Eagle3, Eagle3Config, init_head

    cfg = Eagle3Config.for_target(target.config, draft_vocab=draft_vocab)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32),
                          init_head(cfg, seed))
    d2t = np.sort(rng.choice(target.config.vocab_size, draft_vocab, replace=False)).astype(np.int32)
    params = {**params, "d2t": d2t, "lm_head": {"kernel": np.asarray(target.params["lm_head"]["kernel"])[:, d2t]}}
    return Eagle3(cfg, params)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_export_to_speculators_round_trips(tmp_path, draft_vocab):
    """A head trained here, exported in the speculators format and loaded back, drafts the same logits and the
    same greedy run (target-vocabulary heads get the target's LM head and embedding written in)."""
    from parse_jax.speculation.eagle3 import export_speculators, target_taps
    from tests.speculation.test_eagle3 import random_head

    target = random_model("qwen3", 80, num_layers=8)  # default taps (3, 5, 6): distinct, as speculators needs
    head = random_head(target, 81, scale=0.2) if draft_vocab is None else _random_draft_vocab_head(target, 40, 81)
    out = export_speculators(head, target, tmp_path / "spec", verifier="Qwen/Qwen3-tiny")
    assert head_layout(out) == "speculators"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(head.config.taps)
    assert cfg["draft_vocab_size"] == (draft_vocab or target.config.vocab_size)
    names = set(safetensors.numpy.load_file(out / "model.safetensors"))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "embed_tokens.weight"} <= names
    assert ({"d2t", "t2d"} <= names) == (draft_vocab is not None)
    back = load_eagle3(out, target)
    rng = np.random.default_rng(82)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (2, 10)), jnp.int32)
    from parse_jax.train.forward import train_forward

    _, hiddens = train_forward(target.params, target.config, tokens)
    feats = target_taps(tuple(hiddens), head.config.taps)
    for a, b in zip(ttt_logits(head.params, head.config, target.params, target.config, tokens, feats, 3),
                    ttt_logits(back.params, back.config, target.params, target.config, tokens, feats, 3)):
        if draft_vocab is None:  # exported with the target's LM head as its own: same logits, same ids
            b = np.asarray(b)[..., np.asarray(back.params["d2t"])]
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    one = eagle3_generate(target, head, prompts, gamma=3, max_new_tokens=12)
    two = eagle3_generate(target, back, prompts, gamma=3, max_new_tokens=12)
    assert one.tokens == two.tokens == generate(target, prompts, max_new_tokens=12).tokens
    assert one.stats["accepted_tokens"] == two.stats["accepted_tokens"]
    with pytest.raises(CheckpointError, match="already exists"):
        export_speculators(head, target, out)
    shallow = random_model("qwen3", 80, num_layers=4)  # default taps (2, 3, 3)
    with pytest.raises(ConfigError, match=r"taps layers \[2, 3, 3\], some twice"):
        export_speculators(random_head(shallow, 1), shallow, tmp_path / "other")


def test_a_head_loads_without_its_target_and_is_checked_when_it_meets_one(tmp_path):
    """`pj.load_eagle3(path)` detects every layout on its own; the target's checks (by field) come when the head
    meets a target; a release head naming no layer ids says it needs the target for its taps."""
    import parse_jax as pj
    from parse_jax.engine import ParseEngine
    from parse_jax.speculation.eagle3 import save_eagle3
    from tests.speculation.test_eagle3 import random_head

    target = fixture_target()
    alone = pj.load_eagle3(FIXTURES / "speculators")
    with_target = load_eagle3(FIXTURES / "speculators", target)
    assert alone.config == with_target.config and alone.config.taps == (1, 2, 8)
    own = random_head(target, 3)
    save_eagle3(own, tmp_path / "own")
    assert pj.load_eagle3(tmp_path / "own").config == own.config
    release = _copy("original", tmp_path)  # names no layer ids, as the original release does
    with pytest.raises(ConfigError, match=r"names no eagle_aux_hidden_state_layer_ids.*load_eagle3\(path, target\)"):
        pj.load_eagle3(release)
    assert load_eagle3(release, target).config.taps == (2, 4, 5)  # 2, 8 // 2, 8 - 3 of this 8-layer target
    _edit_config(release, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    assert pj.load_eagle3(release).config.taps == (2, 4, 5)
    _edit_config(release, eagle_aux_hidden_state_layer_ids=[1, 3, 6])  # two sets of taps: refused, never one picked
    with pytest.raises(ConfigError, match=r"names two sets of taps: .*\[2, 4, 5\] and .*\[1, 3, 6\]"):
        pj.load_eagle3(release)
    _edit_config(release, eagle_config={})  # the top-level key alone, where some converters write it
    assert pj.load_eagle3(release).config.taps == (1, 3, 6)
    wide = random_model("qwen3", 0, num_layers=8, hidden_size=64)
    with pytest.raises(ConfigError, match="hidden_size: head 48, target 64"):
        ParseEngine(wide, None, eagle3=alone)
    with pytest.raises(ConfigError, match="vocab_size: head 103, target 90"):
        eagle3_generate(random_model("qwen3", 0, num_layers=8, vocab_size=90), alone, [[1, 2]], max_new_tokens=2)


def test_a_head_loaded_alone_runs_in_its_target_s_dtype(tmp_path):
    """A head loaded without its target keeps its stored dtype; meeting a bfloat16 target (`--dtype bfloat16`) it
    runs in bfloat16, as `load_eagle3(path, target)` loads it, not refused as trained for another target. Anything
    but a head is refused by name, where a head is asked for."""
    import parse_jax as pj
    from parse_jax.engine import ParseEngine
    from parse_jax.models.tokenizer import Tokenizer
    from parse_jax.tasks import TOKENIZER_DIR

    target = fixture_target()  # with the embedded task's word-level tokenizer (27 ids, inside this vocabulary)
    bf16 = Model(target.config.replace(dtype="bfloat16"), jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                                       target.params),
                 Tokenizer.from_folder(TOKENIZER_DIR))
    alone = pj.load_eagle3(FIXTURES / "speculators")
    assert alone.config.layer.dtype == "float32"
    eng = ParseEngine(bf16, None, eagle3=alone)
    assert eng.eagle3.config == load_eagle3(FIXTURES / "speculators", bf16).config
    assert {x.dtype for x in jax.tree.leaves(eng.eagle3.params) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.bfloat16)}
    res = eagle3_generate(bf16, alone, [[1, 2, 3]], max_new_tokens=4, eos_ids=[])
    assert len(res.tokens[0]) == 4 and res.stats["num_drafts"] > 0
    with pytest.raises(ConfigError, match="eagle3 must be an EAGLE-3 head .*got Model"):
        ParseEngine(bf16, None, eagle3=bf16)
    with pytest.raises(ConfigError, match="head must be an EAGLE-3 head .*got Model"):
        pj.export_speculators(bf16, bf16, tmp_path / "spec")
    assert not (tmp_path / "spec").exists()

"""EAGLE-3 heads on disk: this project's folder, the original EAGLE-3 release layout and the `speculators` format
(what vLLM loads); `load_eagle3` tells them apart, `export_speculators` writes the last.

- parse-jax: `eagle3.json` (`Eagle3Config`) + Orbax `params/`.
- the original release (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `config.json` (`LlamaForCausalLMEagle3`, the
  layer's shape, the target's `vocab_size`, `draft_vocab_size`) + safetensors `fc`, `midlayer.*`, `norm`, `lm_head`
  (draft vocabulary), `d2t` (offsets: target id = draft id + d2t[draft id]) and `t2d` (a mask of the target ids),
  or the same tensors in `pytorch_model.bin` as the release ships them (read without torch: `torch_bin`);
  no embedding (the target's); the taps are EAGLE-3's layers 2, L // 2, L - 3 of the target unless the config
  names them (`eagle_config.eagle_aux_hidden_state_layer_ids`, or the same key at the top level).
- speculators: `config.json` with `speculators_config`, `transformer_layer_config` (the layer),
  `eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`, the `norm_*` variants + safetensors `fc`, `layers.0.*`,
  `norm`, `lm_head`, optionally `embed_tokens`, `d2t` / `t2d` when the draft vocabulary is smaller.
Layer ids are `hiddens` indices (the input of layer i; L = the last layer's output), as vLLM collects them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from parse_jax.checkpoints.hf import _HF_CLASSES, hf_config_dict, read_safetensors
from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.models.config import ModelConfig, config_from_hf, read_json_object
from parse_jax.speculation.eagle3.head import Eagle3, Eagle3Config, abstract_params, check_head, check_vocab_map
from parse_jax.speculation.eagle3.torch_bin import BIN_FILE, read_torch_bin
from parse_jax.utils.atomic import replacing
from parse_jax.utils.validation import check_int, check_model, check_path

HEAD_CONFIG_FILE = "eagle3.json"
HEAD_PARAMS_DIR = "params"
HF_CONFIG_FILE = "config.json"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format export_speculators writes
SPECULATORS_LAYERS = ("llama", "qwen3")  # the decoder layers speculators' Eagle3DraftModel builds


def save_eagle3(head: Eagle3, path: str | Path, overwrite: bool = False) -> Path:
    """Write a head as `eagle3.json` + Orbax `params/`, into a temporary folder renamed to `path` once complete
    (with `overwrite`, the new folder replaces the old one whole: nothing else kept in it survives)."""
    check_head("head", head)
    path = Path(check_path("path", path)).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} already exists; pass overwrite=True to replace it")
    with replacing(path) as tmp:
        tmp.mkdir()
        (tmp / HEAD_CONFIG_FILE).write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp / HEAD_PARAMS_DIR, head.params, force=True)
    return path


def head_layout(path: Path) -> str:
    """'parse-jax', 'speculators' or 'eagle3-release': which layout the folder holds, or a CheckpointError."""
    if (path / HEAD_CONFIG_FILE).is_file():
        return "parse-jax"
    if (path / HF_CONFIG_FILE).is_file():
        d = read_json_object(path / HF_CONFIG_FILE, "EAGLE-3 head config.json")
        if "speculators_config" in d or d.get("speculators_model_type") is not None:
            return "speculators"
        if "draft_vocab_size" in d or any("eagle3" in str(a).lower() for a in d.get("architectures") or []):
            return "eagle3-release"
    raise CheckpointError(f"{path} is not an EAGLE-3 head folder: expected {HEAD_CONFIG_FILE} (parse-jax), or a "
                          f"{HF_CONFIG_FILE} with speculators_config (speculators format) or with draft_vocab_size / "
                          "architectures LlamaForCausalLMEagle3 (the original EAGLE-3 release)")


def load_eagle3(path: str | Path, target=None) -> Eagle3:
    """A head in any of the three layouts (detected). With `target`: checked against it (a head trained for another
    target, by hidden size, vocabulary, layer ids or layer count, is a clear error naming the field, not silently
    wrong drafts), cast to its dtype, replicated on its mesh. Without: the head as stored, checked when it meets a
    target (`ParseEngine(..., eagle3=head)`, `eagle3_generate`); a release head that names no layer ids needs the
    target to know its taps (EAGLE-3's 2, L // 2, L - 3) and says so."""
    path = Path(check_path("path", path))
    if not path.is_dir():
        raise CheckpointError(f"EAGLE-3 head folder not found: {path}")
    layout = head_layout(path)
    if layout == "parse-jax":
        cfg, params = _read_parse_jax(path, target)
    else:
        cfg, params = _read_published(path, target, layout)
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype,
                                                                                                   jnp.floating)):
        raise CheckpointError(f"the EAGLE-3 head in {path} has NaN or infinite weights")
    dtype = jnp.dtype(cfg.layer.dtype)
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32),
                          params)  # on device once
    mesh = getattr(target, "mesh", None)
    if mesh is not None:  # the head runs beside the sharded target: whole on every device
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    return Eagle3(cfg, params)


def _follow_dtype(cfg: Eagle3Config, target_cfg: ModelConfig) -> Eagle3Config:
    return dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=target_cfg.dtype))


def _read_parse_jax(path: Path, target) -> tuple[Eagle3Config, dict[str, Any]]:
    cfg_file = path / HEAD_CONFIG_FILE
    try:
        stored = Eagle3Config.from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    cfg = stored
    if target is not None:
        cfg = _follow_dtype(stored, target.config)  # e.g. --dtype bfloat16: follow the target
        cfg.check_target(target.config)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params(stored))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore((path / HEAD_PARAMS_DIR).absolute(), abstract)
    except Exception as e:  # Orbax/TensorStore raise many types for damaged data
        raise CheckpointError(f"cannot restore the EAGLE-3 head params in {path / HEAD_PARAMS_DIR}: {e}") from None
    return cfg, params


# --- the published layouts ----------------------------------------------------------------------------------


def _published_config(d: dict[str, Any], layout: str, target_cfg: ModelConfig | None, where: str) -> Eagle3Config:
    """The head's `Eagle3Config` from its config.json, the unsupported variants refused by name."""
    if layout == "speculators":
        layer_d = d.get("transformer_layer_config")
        if not isinstance(layer_d, dict):
            raise ConfigError(f"{where} field 'transformer_layer_config' must be an object, got {layer_d!r}")
        for flag in ("norm_before_fc", "fc_norm"):
            if d.get(flag):
                raise ConfigError(f"{where} field {flag!r} is true: parse-jax reads EAGLE-3 heads without it "
                                  "(norm_before_residual and norm_output are supported)")
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        extra = {"norm_before_residual": bool(d.get("norm_before_residual", False)),
                 "norm_output": bool(d.get("norm_output", False))}
        if d.get("target_hidden_size") not in (None, layer_d.get("hidden_size")):
            raise ConfigError(f"{where} field 'target_hidden_size' is {d['target_hidden_size']}: parse-jax reads "
                              "heads as wide as their target (target_hidden_size null or the layer's hidden_size)")
    else:
        layer_d, extra = d, {}
        nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        top = d.get("eagle_aux_hidden_state_layer_ids")  # where some converters write it
        if nested is not None and top is not None and nested != top:
            raise ConfigError(f"{where} names two sets of taps: eagle_config.eagle_aux_hidden_state_layer_ids "
                              f"{nested!r} and eagle_aux_hidden_state_layer_ids {top!r}; keep the one the head was "
                              "trained with")
        ids = nested if nested is not None else top
    try:
        layer = config_from_hf({**layer_d, "bos_token_id": None, "eos_token_id": None}, dtype="float32")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if layer.num_layers != 1:
        raise ConfigError(f"{where} field 'num_hidden_layers' is {layer.num_layers}: parse-jax reads one-layer "
                          "EAGLE-3 heads")
    if layer.architecture not in SPECULATORS_LAYERS:
        raise ConfigError(f"{where}: model_type {layer_d.get('model_type')!r} for the head's layer; allowed: "
                          f"{', '.join(SPECULATORS_LAYERS)}")
    if ids is None and target_cfg is None:
        raise ConfigError(f"{where} names no eagle_aux_hidden_state_layer_ids, so its taps are EAGLE-3's default "
                          "layers of its target (2, L // 2, L - 3): load it with load_eagle3(path, target)")
    if ids is None:
        n = target_cfg.num_layers
        ids = [2, n // 2, n - 3]  # EAGLE-3's (and speculators') default
        if len(set(ids)) != 3 or min(ids) < 0:
            raise ConfigError(f"{where} names no eagle_aux_hidden_state_layer_ids and EAGLE-3's default layers "
                              f"(2, L // 2, L - 3) = {ids} are not 3 distinct layers of this {n}-layer target: the "
                              "head was trained for another target")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where} field 'eagle_aux_hidden_state_layer_ids' must be a list of layer ids, got "
                          f"{ids!r}")
    vocab = d.get("draft_vocab_size", layer.vocab_size)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConfigError(f"{where} field 'draft_vocab_size' must be a positive integer, got {vocab!r}")
    return Eagle3Config(layer=layer, taps=tuple(sorted(ids)), target_layers=None, draft_vocab=vocab, **extra)


# published name (after `layers.0.` / `midlayer.` is dropped) -> (param path, transposed)
def _param_name(name: str) -> tuple[tuple[str, ...], bool] | None:
    parts = name.split(".")
    if parts[-1] not in ("weight", "bias"):
        return None
    leaf = parts[-1]
    mod = tuple(parts[:-1])
    if mod == ("embed_tokens",):
        return ("embed_tokens", "embedding"), False
    if mod[-1].endswith("norm"):
        return (*mod, "scale"), False
    return (*mod, "kernel" if leaf == "weight" else "bias"), leaf == "weight"


def read_head_weights(path: Path) -> dict[str, Any]:
    """A published head's tensors: safetensors when the folder has them, else the release's `pytorch_model.bin`
    (read without torch, `torch_bin`)."""
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file() \
            and (path / BIN_FILE).is_file():
        return read_torch_bin(path / BIN_FILE)
    return read_safetensors(path)


def _read_published(path: Path, target, layout: str) -> tuple[Eagle3Config, dict[str, Any]]:
    where = f"{path / HF_CONFIG_FILE}"
    d = read_json_object(path / HF_CONFIG_FILE, "EAGLE-3 head config.json")
    cfg = _published_config(d, layout, None if target is None else target.config, where)
    entries = read_head_weights(path)
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    if any(n.startswith("layers.1.") for n in entries):
        raise ConfigError(f"{path}: the head has more than one decoder layer (layers.1.*); parse-jax reads "
                          "one-layer EAGLE-3 heads")
    # a published head always has its own LM head; without a map it covers the target's ids in order
    cfg = dataclasses.replace(cfg, own_embed="embed_tokens.weight" in entries)
    has_map = "d2t" in entries
    if cfg.draft_vocab != cfg.layer.vocab_size and not has_map:
        raise CheckpointError(f"{path}: draft_vocab_size {cfg.draft_vocab} differs from the target vocabulary "
                              f"{cfg.layer.vocab_size} but the head has no d2t map")
    out_cfg = cfg
    if target is not None:
        out_cfg = _follow_dtype(cfg, target.config)
        out_cfg.check_target(target.config)
    abstract = abstract_params(cfg)
    flat = {tuple(k.key for k in p): s for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    filled: dict[tuple[str, ...], np.ndarray] = {}
    for name, entry in entries.items():
        if name in ("d2t", "t2d"):
            continue
        mapped = _param_name(name[len(prefix):] if name.startswith(prefix) else name)
        if mapped is None or mapped[0] not in flat:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for an EAGLE-3 head of this config")
        key, transpose = mapped
        value = np.asarray(entry.read(), np.float32)
        value = value.T if transpose else value
        if value.shape != flat[key].shape:
            want = flat[key].shape[::-1] if transpose else flat[key].shape
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(entry.shape)}, the config "
                                  f"({HF_CONFIG_FILE}) needs {list(want)}")
        filled[key] = value
    if has_map:
        offsets = np.asarray(entries["d2t"].read()).astype(np.int64)
        if offsets.shape != (cfg.draft_vocab,):
            raise CheckpointError(f"{path}: d2t has shape {list(offsets.shape)}, draft_vocab_size is {cfg.draft_vocab}")
        ids = offsets + np.arange(len(offsets))
        check_vocab_map(ids, cfg.layer.vocab_size, str(path))
        if "t2d" in entries:
            mask = np.asarray(entries["t2d"].read()).astype(bool)
            if mask.shape != (cfg.layer.vocab_size,) or not np.array_equal(np.flatnonzero(mask), np.sort(ids)):
                raise CheckpointError(f"{path}: t2d does not mark exactly the target ids d2t maps to")
        filled[("d2t",)] = ids.astype(np.int32)
    else:
        filled[("d2t",)] = np.arange(cfg.draft_vocab, dtype=np.int32)
    missing = sorted(".".join(k) for k in flat if k not in filled)
    if missing:
        raise CheckpointError(f"{path}: the head lacks {', '.join(missing)}")
    params: dict[str, Any] = {}
    for key, value in filled.items():
        node = params
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return out_cfg, params


# --- export ---------------------------------------------------------------------------------------------------


def _hf(value, transpose: bool = False) -> np.ndarray:
    """float32, C-ordered (safetensors writes the buffer as it lies), a kernel [in, out] as HF's weight [out, in]."""
    value = np.asarray(value, np.float32)
    return np.ascontiguousarray(value.T if transpose else value)


def export_speculators(head: Eagle3, target, out: str | Path, *, verifier: str | None = None,
                       speculative_tokens: int = 3, overwrite: bool = False) -> Path:
    """Write `head` (trained for `target`) in the speculators format vLLM loads: config.json + model.safetensors
    (`fc`, `layers.0.*`, `norm`, `lm_head`, `embed_tokens`, and `d2t` / `t2d` for a draft vocabulary). A head that
    shares the target's LM head gets the target's LM head (and embedding) written into it; `verifier` names the
    target's folder or hub id in `speculators_config.verifier` (vLLM checks it). Written to a temporary folder
    and renamed, so nothing half-written lands under `out`."""
    import safetensors.numpy

    check_head("head", head)
    check_model("target", target)
    speculative_tokens = check_int("speculative_tokens", speculative_tokens, 1, error=InputError)
    cfg, p = head.config, jax.device_get(head.params)
    cfg.check_target(dataclasses.replace(target.config, dtype=cfg.layer.dtype))
    if cfg.layer.architecture not in SPECULATORS_LAYERS:
        raise ConfigError(f"export to speculators: the head's layer is {cfg.layer.architecture!r}; speculators "
                          f"builds EAGLE-3 layers of {', '.join(SPECULATORS_LAYERS)} only")
    if len(set(cfg.taps)) != len(cfg.taps):
        raise ConfigError(f"export to speculators: the head taps layers {list(cfg.taps)}, some twice; speculators "
                          "and vLLM need distinct eagle_aux_hidden_state_layer_ids (train the head with distinct "
                          "taps: `train-eagle3 --data` picks them)")
    tp = jax.device_get(target.params)
    weights: dict[str, np.ndarray] = {"fc.weight": _hf(p["fc"]["kernel"], True), "norm.weight": _hf(p["norm"]["scale"])}

    def put(tree, prefix: str) -> None:
        for name, value in tree.items():
            full = f"{prefix}{name}"
            if isinstance(value, dict) and "kernel" in value:
                weights[f"{full}.weight"] = _hf(value["kernel"], True)
                if "bias" in value:
                    weights[f"{full}.bias"] = _hf(value["bias"])
            elif isinstance(value, dict) and "scale" in value:
                weights[f"{full}.weight"] = _hf(value["scale"])
            elif isinstance(value, dict):
                put(value, f"{full}.")

    put({k: v for k, v in p.items() if k not in ("fc", "norm", "lm_head", "d2t", "embed_tokens")}, "layers.0.")
    table = p["embed_tokens"]["embedding"] if "embed_tokens" in p else tp["embed_tokens"]["embedding"]
    weights["embed_tokens.weight"] = _hf(table)
    vocab = cfg.layer.vocab_size
    if "lm_head" in p:
        weights["lm_head.weight"] = _hf(p["lm_head"]["kernel"], True)
        ids = np.asarray(p["d2t"], np.int64)
    else:
        tied = target.config.tie_word_embeddings
        weights["lm_head.weight"] = (_hf(tp["embed_tokens"]["embedding"]) if tied
                                     else _hf(tp["lm_head"]["kernel"], True))
        ids = np.arange(vocab)
    draft_vocab = len(ids)
    if draft_vocab != vocab:
        weights["d2t"] = ids - np.arange(draft_vocab)
        t2d = np.zeros(vocab, bool)
        t2d[ids] = True
        weights["t2d"] = t2d
    layer = {**hf_config_dict(cfg.layer.replace(dtype="float32", eos_token_ids=(), bos_token_id=None)),
             "num_hidden_layers": 1}
    layer.pop("architectures", None)
    config = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "dtype": "float32", "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(cfg.taps), "norm_before_residual": cfg.norm_before_residual,
        "norm_output": cfg.norm_output, "norm_before_fc": False, "fc_norm": False, "embed_requires_grad": False,
        "target_hidden_size": None, "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier,
                         "architectures": [_HF_CLASSES.get(target.config.architecture, "LlamaForCausalLM")]}},
        "transformer_layer_config": layer,
    }
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        tmp.mkdir()
        (tmp / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        safetensors.numpy.save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return out

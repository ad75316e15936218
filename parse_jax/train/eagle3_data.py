"""Train an EAGLE-3 head for any target on a JSONL dataset, as the EAGLE-3 recipe does (`train-eagle3 --data`).

Records are `{"prompt": ..., "response": ...}` or chat `{"messages": [{"role", "content"}, ...]}` (the prompt is the
chat template rendered up to the last assistant message, the response that message). With `regenerate` the target
writes the responses itself (greedy), so the head learns the target's own distribution; otherwise they are taken as
given. The target's taps and next-token distributions come from the Flax target at every step (it is frozen: no
features are kept on disk), the head is unrolled on its own outputs (training-time test, `ttt_logits`), and with
`draft_vocab_size` the head drafts over the most frequent response tokens only: its LM head is the target's rows
for those ids (frozen, as speculators does), the teacher the target's distribution restricted to them, and the
maps are written as `d2t.npy` / `t2d.npy` (speculators' convention: target id = draft id + d2t[draft id]).

The run folder: `data.json` (the encoded rows and the vocabulary, reused on resume), `head_run/` (the trainer's
checkpoints: a killed run resumes from the last one), then `eagle3/` (parse-jax's layout) and `speculators/` (the
speculators format, what vLLM loads).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from parse_jax.errors import CheckpointError, ConfigError, InputError
from parse_jax.runtime.requests import PAD_ID, encode_prompts
from parse_jax.speculation.eagle3 import (
    Eagle3,
    Eagle3Config,
    export_speculators,
    init_head,
    save_eagle3,
    target_taps,
)
from parse_jax.train.eagle3 import HEAD_OUTPUTS, check_trainable, make_loss, target_fingerprint
from parse_jax.train.forward import train_forward
from parse_jax.train.recipe import Eagle3Spec
from parse_jax.train.trainer import CKPT_DIR, PhaseOptions, clear_outputs, has_checkpoint, train_phase
from parse_jax.utils.atomic import write_json
from parse_jax.utils.progress import bar, logger

DATA_FILE = "data.json"
REGENERATE_BATCH = 32


def data_taps(num_layers: int) -> tuple[int, ...]:
    """Distinct layer ids for a head trained here on data: EAGLE-3's (and speculators') default 2, L // 2, L - 3
    when those are three distinct layers, else three (or, for one layer, two) spread over [0, L]."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    spread = tuple(sorted({int(round(x)) for x in np.linspace(1, num_layers, 3)}))
    return spread if len(spread) == 3 else tuple(range(min(num_layers, 2) + 1))


def read_records(path: str | Path, need_response: bool) -> list[dict[str, Any]]:
    """The JSONL file's records as {"prompt": str} or {"messages": [...]} plus "response" (None when the target
    will write it). A bad line is an InputError naming the line and the field."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--data: file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(rec, dict):
            raise InputError(f"{where}: a record must be a JSON object with prompt/response or messages")
        if "messages" in rec:
            msgs = rec["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise InputError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings")
            response = msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else None
            prompt_msgs = msgs[:-1] if response is not None else msgs
            if not prompt_msgs:
                raise InputError(f"{where}: field 'messages' has no message before the assistant's")
            out.append({"messages": prompt_msgs, "response": response, "where": where})
        elif isinstance(rec.get("prompt"), str):
            response = rec.get("response")
            if response is not None and not isinstance(response, str):
                raise InputError(f"{where}: field 'response' must be a string, got {type(response).__name__}")
            out.append({"prompt": rec["prompt"], "response": response, "where": where})
        else:
            raise InputError(f"{where}: a record needs 'prompt' (a string, with 'response') or 'messages'")
        if need_response and out[-1]["response"] is None:
            raise InputError(f"{where}: no response (a 'response' field or a last assistant message); pass "
                             "--regenerate to have the target write the responses")
    if not out:
        raise InputError(f"--data: {path} holds no records")
    return out


def _prompt_ids(target, rec: dict[str, Any]) -> list[int]:
    if "messages" in rec:
        try:
            text = target.tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True)
        except InputError as e:  # e.g. a role the target's template does not know: name the record's line
            raise InputError(f"{rec.get('where', '--data')}: {e}") from None
        return target.tokenizer.encode(text)
    return encode_prompts(target, [rec["prompt"]])[0]


def encode_rows(target, records: list[dict[str, Any]], spec: Eagle3Spec, regenerate: bool,
                progress: bool) -> np.ndarray:
    """[N, seq_len + 2] rows: prompt ids, response ids, EOS, padding; then the prompt length and the row length
    (padding is id 0, a real token of most vocabularies: the lengths say which are real)."""
    if target.tokenizer is None:
        raise ConfigError("train-eagle3 --data needs a target with a tokenizer (an HF folder with tokenizer.json)")
    eos = target.tokenizer.eos_id
    full_prompts = [_prompt_ids(target, r) for r in records]
    prompts = [p[: spec.seq_len - 1] for p in full_prompts]
    if regenerate:
        from parse_jax.runtime.decode import generate

        responses = []
        with bar(len(prompts), "target writing the responses", enabled=progress, unit="record") as pbar:
            for i in range(0, len(prompts), REGENERATE_BATCH):
                chunk = prompts[i: i + REGENERATE_BATCH]
                budget = max(1, spec.seq_len - min(len(p) for p in chunk))
                responses += generate(target, chunk, max_new_tokens=budget, add_bos=False).tokens
                pbar.update(len(chunk))
    else:
        responses = [target.tokenizer.encode(r["response"]) for r in records]
    rows = np.full((len(records), spec.seq_len + 2), PAD_ID, np.int32)
    # each record's whole length: prompt, response, EOS; regenerated responses are written up to the row's end, so
    # there only a prompt that leaves no room for a response token is cut
    lengths = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tail = list(r) + ([eos] if eos is not None else [])
        lengths.append(len(full_prompts[i]) + (1 if regenerate else len(tail)))
        row = (p + tail)[: spec.seq_len]
        rows[i, : len(row)] = row
        rows[i, -2], rows[i, -1] = len(p), len(row)
    check_trainable(rows[:, -2], rows[:, -1], spec.seq_len, max(lengths))
    report_cut_rows(records, lengths, rows, spec.seq_len, regenerate)
    return rows


def report_cut_rows(records: list[dict[str, Any]], lengths: list[int], rows: np.ndarray, seq_len: int,
                    regenerate: bool = False) -> None:
    """Warn, naming --seq-len, when records are longer than a row: their tokens past it are not trained on (rows
    are cut at the end, as speculators' and the EAGLE-3 recipes' max length cuts them). Silent cuts trained heads
    on system prompts alone. `regenerate`: `lengths` are the prompts' plus one response token (the target writes
    each response up to the row's end)."""
    cut = [i for i, n in enumerate(lengths) if n > seq_len]
    if not cut:
        return
    longest = max(cut, key=lambda i: lengths[i])
    empty = int(((rows[:, -1] - rows[:, -2]) <= 0).sum())
    logger.warning(f"--seq-len {seq_len} cuts {len(cut)} of {len(records)} records (the longest, "
                   f"{records[longest].get('where', 'a record')}, has {lengths[longest]} tokens"
                   + (f"; {empty} keep no response token" if empty else "")
                   + f"): their tokens past {seq_len} are not trained on; --seq-len {max(lengths)} fits them all"
                   + (" (the target writes each response up to --seq-len)" if regenerate else ""))


def draft_vocabulary(rows: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent response tokens (ties by id; padded with the lowest unused ids, as speculators
    does), sorted: the draft ids' target ids."""
    counts: collections.Counter[int] = collections.Counter()
    for row in rows:
        counts.update(int(x) for x in row[int(row[-2]): int(row[-1])])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    for t in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(t)
    return np.asarray(sorted(chosen), np.int32)


def _data_key(path: Path, spec: Eagle3Spec, regenerate: bool, target) -> dict[str, Any]:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"data_sha256": digest, "samples": spec.samples, "seq_len": spec.seq_len, "regenerate": regenerate,
            "draft_vocab_size": spec.draft_vocab_size, "target": target_fingerprint(target)}


def prepare(target, data: str | Path, spec: Eagle3Spec, out: Path, regenerate: bool,
            progress: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(rows, draft ids or None), cached in `out/data.json` (keyed by the file's hash, the settings, the target)."""
    path = Path(data)
    records = read_records(path, need_response=not regenerate)[: spec.samples]
    key = _data_key(path, spec, regenerate, target)
    cached = out / DATA_FILE
    if cached.is_file():
        try:
            d = json.loads(cached.read_text())
            if d["key"] == key:
                ids = d["d2t"]
                return np.asarray(d["rows"], np.int32), None if ids is None else np.asarray(ids, np.int32)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # damaged or stale: encode again
    rows = encode_rows(target, records, spec, regenerate, progress)
    vocab = target.config.vocab_size
    ids = None
    if spec.draft_vocab_size and spec.draft_vocab_size < vocab:
        ids = draft_vocabulary(rows, spec.draft_vocab_size, vocab)
    out.mkdir(parents=True, exist_ok=True)
    write_json(cached, {"key": key, "rows": rows.tolist(), "d2t": None if ids is None else ids.tolist()})
    return rows, ids


def _frozen_parts(target, ids: np.ndarray | None) -> dict[str, Any]:
    """A draft vocabulary's LM head (the target's rows for `ids`, frozen) and map; nothing for the full one."""
    if ids is None:
        return {}
    p, cfg = target.params, target.config
    kernel = p["embed_tokens"]["embedding"].T if cfg.tie_word_embeddings else p["lm_head"]["kernel"]
    return {"lm_head": {"kernel": jnp.asarray(kernel)[:, ids]}, "d2t": jnp.asarray(ids)}


def make_data_loss(target, cfg: Eagle3Config, spec: Eagle3Spec, frozen: dict[str, Any]):
    """`loss(head_params, batch)`: the target's taps and distribution (over the draft vocabulary when there is
    one) computed from `batch["tokens"]` by the frozen Flax target, then `make_loss`'s unrolled soft
    cross-entropy."""
    base = make_loss(target, cfg, spec)
    ids = frozen.get("d2t")

    def loss(head_params, batch):
        logits, hiddens = train_forward(target.params, target.config, batch["tokens"])
        if ids is not None:
            logits = logits[..., ids]
        features = jax.lax.stop_gradient(target_taps(hiddens, cfg.taps))
        teacher = jax.lax.stop_gradient(jax.nn.softmax(logits, axis=-1))
        return base({**head_params, **frozen}, {**batch, "features": features, "teacher": teacher})

    return loss


def train_eagle3_data(target, data: str | Path, out: str | Path, spec: Eagle3Spec | None = None, *,
                      regenerate: bool = False, run: PhaseOptions | None = None, verifier: str | None = None) -> Eagle3:
    """Train (or resume) a head for `target` on a JSONL file into `out`; returns it, saved in `out/eagle3/` and,
    where speculators can express it, `out/speculators/` (`verifier`: the target's folder or hub id it names).
    `run`: how the trainer runs (`mode`, `progress`, `on_step` of `PhaseOptions`; its init and loss are this
    head's)."""
    spec = spec or Eagle3Spec()
    run = run or PhaseOptions()
    progress = run.progress
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"EAGLE-3 training: out {out} is a file; a training run needs a folder")
    vocab = target.config.vocab_size
    if spec.draft_vocab_size > vocab:
        raise ConfigError(f"draft_vocab_size (--draft-vocab-size) {spec.draft_vocab_size} is above the target's "
                          f"vocabulary of {vocab}; allowed 0 (the full vocabulary) to {vocab}")
    if run.mode == "resume" and not has_checkpoint(out / "head_run"):  # before the data's encoding or regeneration
        raise CheckpointError(f"nothing to resume in {out}: no checkpoint in {out / 'head_run' / CKPT_DIR}")
    rows, ids = prepare(target, data, spec, out, regenerate, progress)
    cfg = Eagle3Config.for_target(target.config, taps=data_taps(target.config.num_layers),
                                  draft_vocab=None if ids is None else len(ids))
    frozen = _frozen_parts(target, ids)
    n = len(rows)

    def batch_fn(step: int) -> dict[str, np.ndarray]:
        idx = np.random.default_rng([spec.seed, step]).integers(0, n, spec.batch_size)
        return {"tokens": rows[idx, :-2], "prompt_len": rows[idx, -2], "length": rows[idx, -1]}

    fingerprint: dict[str, Any] = {"eagle3": cfg.to_dict(), "eagle3_spec": dataclasses.asdict(spec),
                                   "data": _data_key(Path(data), spec, regenerate, target)}
    options = dataclasses.replace(run, init=init_head(cfg, spec.seed), loss=make_data_loss(target, cfg, spec, frozen))
    if options.mode == "fresh":  # an earlier run's finished head goes with its checkpoints
        clear_outputs(out, HEAD_OUTPUTS)
    params, _ = train_phase("eagle3", cfg.layer, spec.phase(), batch_fn, out / "head_run", fingerprint, options)
    head = Eagle3(cfg, {**jax.device_get(params), **jax.device_get(frozen)})
    save_eagle3(head, out / "eagle3", overwrite=True)
    if ids is not None:
        np.save(out / "d2t.npy", (ids - np.arange(len(ids))).astype(np.int64))
        t2d = np.zeros(target.config.vocab_size, bool)
        t2d[ids] = True
        np.save(out / "t2d.npy", t2d)
    try:
        export_speculators(head, target, out / "speculators", verifier=verifier, overwrite=True)
    except ConfigError as e:  # e.g. a layer type speculators does not build: the parse-jax head still stands
        print(f"not written in the speculators format: {e}", file=sys.stderr)
    return head

"""Quality measures of a trained pair: greedy accuracy, judge AUROC, one-token decode step cost."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from parse_jax.runtime.decode import generate
from parse_jax.tasks import Task
from parse_jax.train.data import Encoder, JudgeExample, prefixes
from parse_jax.utils.progress import bar


def solve_many(model, task: Task, prompts: Sequence[str], max_new_tokens: int = 24, temperature: float = 0.0,
               seed: int = 0, batch: int = 256, progress: str | None = None) -> list[str]:
    """The model's answers to `prompts`, `batch` at a time; `progress`: the label of a bar on stderr counting
    problems (None: no bar)."""
    enc = Encoder(model.tokenizer, task)
    out: list[str] = []
    with bar(len(prompts), progress or "solving", enabled=progress is not None, unit="problem") as pbar:
        for i in range(0, len(prompts), batch):
            ids = [enc.prompt_ids(p) for p in prompts[i: i + batch]]
            res = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
            out += res.texts
            pbar.update(len(ids))
    return out


def accuracy(model, task: Task, n: int = 1000, seed: int = 0, max_new_tokens: int = 24) -> tuple[float, list]:
    probs = task.problems(n, seed)
    prompts = [p for p, _ in probs]
    texts = solve_many(model, task, prompts, max_new_tokens)
    ok = [task.grade(p, t) for p, t in zip(prompts, texts)]
    return float(np.mean(ok)), list(zip(prompts, texts))


def judge_scores(model, task: Task, examples: Sequence[JudgeExample], batch: int = 256) -> np.ndarray:
    """p(Correct) / (p(Correct) + p(Incorrect)) after each verification prompt."""
    enc = Encoder(model.tokenizer, task)
    yes, no = enc.judge_ids[True], enc.judge_ids[False]
    out = []
    for i in range(0, len(examples), batch):
        rows = [enc.judge_row(e)[:-1] for e in examples[i: i + batch]]
        width = max(len(r) for r in rows)
        width = 1 << (width - 1).bit_length()
        ids = np.zeros((batch, width), np.int32)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = r
        logits = model.logits(ids)
        last = logits[np.arange(len(rows)), [len(r) - 1 for r in rows]]
        out.append(1.0 / (1.0 + np.exp(last[:, no] - last[:, yes])))
    return np.concatenate(out)


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of `scores` for the boolean labels `positive` (ties count half)."""
    scores, positive = np.asarray(scores, np.float64), np.asarray(positive, bool)
    pos, neg = scores[positive], scores[~positive]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    allv = np.concatenate([pos, neg])[order]
    # average ranks for ties
    i = 0
    while i < len(allv):
        j = i
        while j + 1 < len(allv) and allv[j + 1] == allv[i]:
            j += 1
        ranks[order[i: j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def heldout_prefixes(task: Task, draft_outputs: Sequence[tuple[str, str]], n_synthetic: int = 1000,
                     seed: int = 1) -> tuple[list[JudgeExample], list[str]]:
    """Held-out prefixes: every prefix of the draft's outputs on test problems, plus synthetic corruptions and
    clean solutions (random order) of other test problems. Returns (examples, source per example)."""
    import random

    exs, src = [], []
    for p, t in draft_outputs:
        for e in prefixes(task, p, t):
            exs.append(e)
            src.append("draft")
    rng = random.Random(seed)
    for i, (p, _) in enumerate(task.problems(n_synthetic, seed + 100)):
        sol = task.solve(p, rng)
        if i % 2:
            sol, _ = task.corrupt(p, sol, rng)
        for e in prefixes(task, p, sol):
            exs.append(e)
            src.append("synthetic")
    return exs, src


def judge_auroc(target, task: Task, draft_outputs, n_synthetic: int = 1000) -> dict[str, float]:
    """AUROC of 1 - score for 'this prefix contains an error', overall and per source."""
    exs, src = heldout_prefixes(task, draft_outputs, n_synthetic)
    scores = judge_scores(target, task, exs)
    err = np.array([not e.correct for e in exs])
    src = np.array(src)
    out = {"auroc": auroc(1 - scores, err), "n_prefixes": len(exs), "error_rate": float(err.mean())}
    for s in ("draft", "synthetic"):
        m = src == s
        out[f"auroc_{s}"] = auroc(1 - scores[m], err[m])
        out[f"n_{s}"] = int(m.sum())
    return out


def step_seconds(model, batch: int = 1, short: int = 16, long: int = 112, repeats: int = 5) -> float:
    """Seconds per one-token decode step inside the jitted while loop (EOS disabled): the difference between a
    long and a short generation, divided by the extra steps (cancels prefill and dispatch). Median of repeats."""
    bos = model.tokenizer.bos_id if model.tokenizer is not None else 1
    prompts = [[bos, 5 + i % 10] for i in range(batch)]
    vals = []
    for n in (short, long):  # compile both
        generate(model, prompts, max_new_tokens=n, eos_ids=[])
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(model, prompts, max_new_tokens=short, eos_ids=[])
        t1 = time.perf_counter()
        generate(model, prompts, max_new_tokens=long, eos_ids=[])
        t2 = time.perf_counter()
        vals.append(((t2 - t1) - (t1 - t0)) / (long - short))
    return float(np.median(vals))


def token_diff_fraction(task: Task, draft_outputs, target_outputs) -> float:
    """Among problems the draft solves correctly: the share where its text differs from the target's."""
    d = [(p, a, b) for (p, a), (_, b) in zip(draft_outputs, target_outputs) if task.grade(p, a)]
    return float(np.mean([a.strip() != b.strip() for _, a, b in d])) if d else float("nan")


def evaluate_pair(out, n: int = 1000, n_synthetic: int | None = None, batch_sizes: Sequence[int] = (1, 16)) -> dict:
    """Every quality bar of the embedded pair (docs/training.md) for the pair in `out` (draft/ and target/ folders),
    on `n` held-out problems: accuracy on them, the judge's AUROC on every prefix of the draft's samples for them and
    of `n_synthetic` (default: `n`) other problems' clean and corrupted solutions. A measure with nothing to measure
    (no correct draft solution, no erroneous prefix) is NaN, written as null in JSON."""
    from parse_jax.checkpoints.pair import load_pair
    from parse_jax.tasks import load_task

    n_synthetic = n if n_synthetic is None else n_synthetic
    target, draft = load_pair(out, dtype="float32")  # as the bench and the engine use them (bf16 on disk is upcast)
    task = load_task()
    res: dict = {"n": n, "n_synthetic_problems": n_synthetic}
    t0 = time.perf_counter()
    res["target_accuracy"], t_out = accuracy(target, task, n)
    res["draft_accuracy"], d_out = accuracy(draft, task, n)
    res["accuracy_s"] = time.perf_counter() - t0
    res["draft_correct_differs_from_target"] = token_diff_fraction(task, d_out, t_out)
    t0 = time.perf_counter()
    # held-out real draft outputs: sampled (T=1) on the held-out problems, as the judge would see them
    prompts = [p for p, _ in task.problems(n, 0)]
    sampled = solve_many(draft, task, prompts, temperature=1.0, seed=12345)
    res.update(judge_auroc(target, task, list(zip(prompts, sampled)), n_synthetic))
    res["auroc_s"] = time.perf_counter() - t0
    for b in batch_sizes:
        td, tt = step_seconds(draft, b), step_seconds(target, b)
        res[f"step_us_draft_b{b}"], res[f"step_us_target_b{b}"] = td * 1e6, tt * 1e6
        res[f"step_cost_ratio_b{b}"] = tt / td
    return res


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m parse_jax.train.evaluate`: the results as strict JSON on stdout (and in --json); undefined
    measures are null."""
    import argparse
    import sys

    from parse_jax.checkpoints.pair import PAIR_DIR
    from parse_jax.errors import ParseJaxError
    from parse_jax.utils.atomic import json_text, write_json
    from parse_jax.utils.validation import check_int

    ap = argparse.ArgumentParser(prog="python -m parse_jax.train.evaluate",
                                 description="measure the quality bars of a trained pair")
    ap.add_argument("--out", "--pair", dest="out", default=None,
                    help="folder with draft/ and target/ (default: the pair shipped in the package)")
    ap.add_argument("--n", type=int, default=1000,
                    help="held-out problems: accuracy on N, the judge's AUROC on the prefixes of the draft's samples "
                         "for them and of N synthetic solutions (about 4 prefixes a problem each)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    try:
        check_int("--n", a.n, 1)
        r = evaluate_pair(a.out or PAIR_DIR, a.n)
    except ParseJaxError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    r["command"] = "python -m parse_jax.train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv)
    print(json_text(r))
    if a.json:
        write_json(a.json, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

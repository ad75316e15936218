"""lm-evaluation-harness parity: `lm_eval.simple_evaluate(model="parse-jax", ...)` on the shipped embedded-task YAML
(configs/lm_eval/parse_jax_embedded.yaml) over a local JSONL file of 100 embedded-task problems, against
`parse-jax eval` (`pj.evaluate`) on the same records and mode; the per-record outputs are compared too, and the
speculation stats the lm-eval run wrote are kept.

    python benchmarks/lm_eval_parity.py [--n 100] [--mode parse] [--out benchmarks/results/lm_eval_parity]

Needs lm-eval (the `lm-eval` extra: `pip install 'parse-jax[lm-eval]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

import parse_jax as pj
from parse_jax.harness import lm_eval_model  # noqa: F401  (registers "parse-jax" in lm-eval's registry)
from parse_jax.harness.eval.data import write_task_jsonl
from parse_jax.harness.provenance import provenance
from parse_jax.utils import atomic
from parse_jax.utils.paths import config_dir


def main(argv: list[str] | None = None) -> int:
    import lm_eval

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--mode", default="parse")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7, help="which held-out problems (the task's test split)")
    ap.add_argument("--out", default="benchmarks/results/lm_eval_parity")
    args = ap.parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_task_jsonl(pj.load_task(), args.n, Path(tmp) / "problems.jsonl", seed=args.seed)
        task = yaml.safe_load((config_dir() / "lm_eval" / "parse_jax_embedded.yaml").read_text())
        task["dataset_kwargs"] = {"data_files": {"test": str(data)}}
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(model="parse-jax", model_args={"mode": args.mode, "batch_size": args.batch_size,
                                                                     "stats_path": str(out / "speculation_stats.json")},
                                      tasks=[task], log_samples=True)
        lm_seconds = time.perf_counter() - t0
        target, draft = pj.load_pair()
        t0 = time.perf_counter()
        ours = pj.evaluate(target, draft, data, mode=args.mode, batch_size=args.batch_size,
                           max_new_tokens=task["generation_kwargs"]["max_gen_toks"])
        our_seconds = time.perf_counter() - t0
        prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines()]
    samples = {s["doc"]["prompt"]: s for s in res["samples"]["parse_jax_embedded"]}
    same_output = sum(samples[p]["resps"][0][0] == r["output"] for p, r in zip(prompts, ours.records))
    same_score = sum(bool(samples[p]["exact_match"]) == bool(r["correct"]) for p, r in zip(prompts, ours.records))
    acc = res["results"]["parse_jax_embedded"]["exact_match,final_answer"]
    doc = {"n": args.n, "mode": args.mode, "lm_eval_version": lm_eval.__version__,
           "lm_eval_accuracy": acc, "parse_jax_eval_accuracy": ours.accuracy,
           "parse_jax_eval_ci95": list(ours.accuracy_ci95), "equal": acc == ours.accuracy,
           "records_with_the_same_output": same_output, "records_with_the_same_score": same_score,
           "lm_eval_seconds": lm_seconds, "parse_jax_eval_seconds": our_seconds,
           "speculation_stats": res["config"]["speculation_stats"],
           "command": "python benchmarks/lm_eval_parity.py " + " ".join(argv or sys.argv[1:]),
           "provenance": provenance({"n": args.n, "mode": args.mode, "seed": args.seed}, args.seed)}
    atomic.write_json(out / "lm_eval_parity.json", doc)
    st = doc["speculation_stats"]
    md = [f"# lm-eval parity ({args.mode}, {args.n} embedded-task problems)", "",
          f"Command: `{doc['command']}`", "",
          "| | accuracy |", "|---|---|",
          "| `lm_eval.simple_evaluate(model=\"parse-jax\")`, configs/lm_eval/parse_jax_embedded.yaml | "
          f"{100 * acc:.1f}% |",
          f"| `parse-jax eval` (`pj.evaluate`) | {100 * ours.accuracy:.1f}% (95% CI {100 * ours.accuracy_ci95[0]:.1f}"
          f"-{100 * ours.accuracy_ci95[1]:.1f}) |", "",
          f"Same output on {same_output}/{args.n} records, same score on {same_score}/{args.n}. Speculation stats of "
          f"the lm-eval run: {st.get('num_verifications')} verification passes, {st.get('num_steps_drafted')} steps "
          f"drafted, {st.get('accepted_tokens_per_verification', 0):.2f} accepted tokens per verification, first "
          f"rejected step histogram {st.get('first_rejected_step_hist')}.", ""]
    atomic.write_text(out / "lm_eval_parity.md", "\n".join(md))
    print("\n".join(md))
    return 0 if doc["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

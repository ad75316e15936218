"""`parse-jax profile`: measure what one forward pass of the target, the draft and the EAGLE-3 head costs on this
device (batch x tokens per pass x cache length), and cache the tables where `schedule="auto"` finds them."""

from __future__ import annotations

import argparse
import json

from parse_jax.cli.setup import models_from_args
from parse_jax.utils.progress import phase


def cmd_profile(args: argparse.Namespace) -> int:
    from parse_jax.schedule.costs import CostTable
    from parse_jax.schedule.profile import DRAFTER_GRID, Grid, fingerprint, head_model, load_or_profile, profile_path
    from parse_jax.utils import atomic

    target, draft = models_from_args(args, need_draft=False)
    models = [("target", target, Grid())]
    if draft is not None:
        models.append(("draft", draft, DRAFTER_GRID))
    if target.eagle3 is not None:
        models.append(("eagle3", head_model(target.eagle3.config.layer), DRAFTER_GRID))
    paths = [profile_path(fingerprint(model, grid)) for _, model, grid in models]
    for path in [*paths, *([args.json] if args.json else [])]:  # before any measuring, not after it
        atomic.check_file_writable(path)
    report = {}
    for (role, model, grid), path in zip(models, paths):
        # --force: measured again; the cached file is replaced only by a whole new table (an interrupt keeps it)
        phase(f"{role}: pass costs (measured unless cached in {path}: a few minutes on a CPU)")
        table: CostTable = load_or_profile(model, measure=True, grid=grid, force=args.force)
        report[role] = {"file": str(path), "batches": list(table.batches), "tokens": list(table.tokens),
                        "caches": list(table.caches), "seconds": table.seconds_grid}
        print(f"{role}: {path}")
        for c, cache in enumerate(table.caches):
            print(f"  cache {cache}: ms per pass, rows = batch, columns = tokens per pass {list(table.tokens)}")
            for b, batch in enumerate(table.batches):
                row = " ".join(f"{table.seconds_grid[b][t][c] * 1e3:8.2f}" for t in range(len(table.tokens)))
                print(f"    batch {batch:3d} {row}")
    if args.json:
        atomic.write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


def add_profile_command(sub, add_model_args) -> None:
    p = sub.add_parser("profile", help="measure forward-pass costs on this device for schedule=auto (cached)")
    add_model_args(p)
    p.add_argument("--force", action="store_true", help="measure again even where a cached profile exists")
    p.add_argument("--json", default=None, help="also write the tables to this JSON file")
    p.set_defaults(func=cmd_profile)

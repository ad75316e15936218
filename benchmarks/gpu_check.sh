#!/usr/bin/env bash
# The GPU check: one command on one GPU (H200, JAX with CUDA, no network), <= 8 minutes in all.
#
#     bash benchmarks/gpu_check.sh            # results under $OUT (default ./out/gpu_check)
#
# Each section runs under its own timeout and writes its log and results under $OUT/<section>/; a failing or
# timed-out section is recorded in $OUT/sections.tsv and the next one still runs. To add a section, append one
# `section NAME SECONDS COMMAND...` line below and keep the sum of the timeouts and their kill margins at or under 7 minutes
# (tests/benchmarks/test_gpu_check.py): a call to a lent machine has a 10-minute limit, the start included, and a
# command killed at that limit returns none of its files.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./out/gpu_check}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
printf 'section\texit_code\tseconds\n' > "$OUT/sections.tsv"
KILL_AFTER=10  # seconds a timed-out section gets after SIGTERM

section() {
  local name="$1" seconds="$2"
  shift 2
  mkdir -p "$OUT/$name"
  echo "== $name (timeout ${seconds}s): $*"
  local start=$SECONDS
  timeout --kill-after=$KILL_AFTER "$seconds" "$@" 2>&1 | tee "$OUT/$name/log.txt"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/sections.tsv"
  [ "$rc" = 0 ] || echo "== $name failed (exit $rc; 124 = timed out); see $OUT/$name/log.txt"
}

section environment 20 python -c "import jax, flax, parse_jax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
# The kernel tests compiled on this GPU (needs pytest, hypothesis and parse_jax's dependencies)...
section kernel_tests 70 python -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_kernels.py -k compiled -rs
# ...the engine on this GPU: every mode's greedy tokens against the target's (XLA path and the Pallas kernel),
# batch-1 tokens/s per mode, and what schedule="auto" ran at batch 1 and 16 on this device's costs...
section engine 120 python benchmarks/gpu_engine_check.py --out "$OUT/engine" --n 8 --budget-s 85
# ...the multi-prefix attention kernel against the XLA path and dense masked attention (timings, errors)...
section kernel_bench 90 python benchmarks/gpu_kernel_bench.py --out "$OUT/kernel_bench" --budget-s 60
# ...and a Qwen3-8B-shaped target / Qwen3-0.6B-shaped draft (random bf16 weights): verification pass vs prefill vs
# decode step, the numbers that predict PARSE's speed-up on this GPU (rows are written as they finish).
section model_cost 70 python benchmarks/gpu_model_cost.py --out "$OUT/model_cost" --batches 1,16 --draft-lens 512 --ks 16 --repeats 3 --passes 2 --budget-s 45

echo "== sections (exit code 0 = ok):"
cat "$OUT/sections.tsv"

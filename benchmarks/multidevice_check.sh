#!/usr/bin/env bash
# Sharded == unsharded and verification timing on the devices of this machine (or job).
#   GPU host (all local GPUs):     bash benchmarks/multidevice_check.sh
#   TPU VM / pod slice (each host): bash benchmarks/multidevice_check.sh --distributed
#   CPU smoke run (8 fake devices): CPU_SMOKE=1 bash benchmarks/multidevice_check.sh
# Extra arguments go to benchmarks/multidevice_check.py (e.g. --layers 32 --hidden 4096 --batch 32).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${CPU_SMOKE:-0}" == "1" ]]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8"
  set -- --layers 2 --hidden 256 --vocab 512 --batch 4 --context 32 --draft 32 --prefixes 4 --repeats 3 \
         --dtype float32 --out /tmp/multidevice_check_smoke "$@"
fi
python benchmarks/multidevice_check.py "$@"

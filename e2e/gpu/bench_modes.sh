#!/usr/bin/env bash
# Side-by-side makespan of normal / mixed / pd on one GPU, through the HTTP server, with the
# Qwen3-30B-A3B shape (random bf16 weights made on the device) and the `gpu` trace preset.
# Usage (on the GPU machine, from the repo root): bash e2e/gpu/bench_modes.sh OUTDIR [PRESSURE...]
set -uo pipefail
out="${1:?output dir}"; shift
pressures=("${@:-P1}")
source "$(dirname "$0")/env.sh"
model=/tmp/pdrollout-bench-model
mkdir -p "$model" "$out"
python3 - "$model" "${LAYERS:-48}" <<'PY'
import json, sys
from pdrollout.engine.config import load_preset
cfg = load_preset("qwen3-30b-a3b")
cfg["num_hidden_layers"] = int(sys.argv[2])
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
PY
engine_config='{"random_weights": true, "dtype": "bfloat16", "kv_cache_bytes": 42949672960, "max_running": 64}'
for p in "${pressures[@]}"; do
  pdrollout bench --modes "${MODES:-normal,mixed,pd}" --model "$model" --preset "${PRESET:-gpu}" --pressure "$p" \
    --device cuda --serve-arg=--engine-config --serve-arg="$engine_config" --no-progress --out "$out/$p" \
    || echo "bench at $p failed"
done

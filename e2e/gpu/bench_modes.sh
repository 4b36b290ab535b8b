#!/usr/bin/env bash
# Side-by-side makespan of normal / mixed / pd on one GPU, through the HTTP server, with the
# Qwen3-30B-A3B shape (random bf16 weights made on the device).
# Usage (GPU machine, repo root): bash e2e/gpu/bench_modes.sh OUTDIR [PRESSURE...]
#   PRESET=gpu (default) | decode-only   MODES=normal,mixed,pd   LAYERS=48   CONTROL='{"activation":"on"}'
set -uo pipefail
out="${1:?output dir}"; shift
pressures=("${@:-P1}")
source "$(dirname "$0")/env.sh"
model=/tmp/pdrollout-bench-model
mkdir -p "$model" "$out"
python3 - "$model" "${LAYERS:-48}" <<'PY'
import json, sys
from pdrollout.engine.protocol.config import load_preset
cfg = load_preset("qwen3-30b-a3b")
cfg["num_hidden_layers"] = int(sys.argv[2])
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
# Decode-only workload: 64 single-turn requests, short prompts, long outputs, released at once.
with open("/tmp/pdrollout-decode-only.jsonl", "w") as f:
    for i in range(64):
        f.write(json.dumps({"session_id": f"s{i}", "turn": 0, "timestamp": 0, "input_length": 32,
                            "output_length": 256, "delay_ms": 0}) + "\n")
PY
engine_config="{\"random_weights\": true, \"dtype\": \"bfloat16\", \"kv_cache_bytes\": 42949672960, \"max_running\": 64, \"control\": ${CONTROL:-{\}}}"
if [ "${PRESET:-gpu}" = decode-only ]; then src=(--trace /tmp/pdrollout-decode-only.jsonl); else src=(--preset "${PRESET:-gpu}"); fi
for p in "${pressures[@]}"; do
  pdrollout bench --modes "${MODES:-normal,mixed,pd}" --model "$model" "${src[@]}" --pressure "$p" \
    --device cuda --serve-arg=--engine-config --serve-arg="$engine_config" --no-progress --out "$out/$p" \
    || echo "bench at $p failed"
done

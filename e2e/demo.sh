#!/usr/bin/env bash
# The main job on embedded defaults: a tiny random Qwen3-MoE, the tiny agentic trace, and the
# side-by-side makespan of `normal` (multiplexing off) vs `pd` (in-place P/D) on the CPU.
# Prints the ratio table; results.json and PNG plots land in $PDROLLOUT_DEMO_DIR (default below).
set -euo pipefail
cd "$(dirname "$0")/.."
source e2e/lib/env.sh
pdrollout_venv
demo="${PDROLLOUT_DEMO_DIR:-$PDROLLOUT_CACHE/demo}"
mkdir -p "$demo"
if [ ! -f "$demo/model/config.json" ]; then
  pdrollout checkpoint --config tiny --out "$demo/model" --seed 0
fi
pdrollout bench --modes "${MODES:-normal,pd}" --model "$demo/model" --preset tiny --pressure "${PRESSURE:-P2}" \
  --device cpu --out "$demo/results"
echo "[demo] results: $demo/results (results.json, makespan.png, ttft_cdf.png, timeline.png)"

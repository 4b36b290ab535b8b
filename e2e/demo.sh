#!/usr/bin/env bash
# The main job on embedded defaults: a tiny random Qwen3-MoE, the tiny agentic trace cut to its first
# $SESSIONS conversations (three modes in about the time two took on the whole trace), and the
# side-by-side makespan of `normal` (multiplexing off), `mixed` (chunked prefill, SGLang's default)
# and `pd` (in-place P/D) on the CPU.
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
pdrollout trace --preset tiny --seed 0 --out "$demo/trace-full.jsonl" >/dev/null
python - "$demo/trace-full.jsonl" "$demo/trace.jsonl" "${SESSIONS:-6}" <<'PY'
import json, sys
src, out, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(line) for line in open(src)]
first = sorted({r["session_id"] for r in rows})[:keep]
with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows if r["session_id"] in first)
PY
pdrollout bench --modes "${MODES:-normal,mixed,pd}" --model "$demo/model" --trace "$demo/trace.jsonl" \
  --pressure "${PRESSURE:-P2}" --device cpu --out "$demo/results"
echo "[demo] results: $demo/results (results.json, makespan.png, ttft_cdf.png, timeline.png)"
echo "[demo] What these figures mean: a tiny random model on this machine's CPU, where a step costs" \
     "mostly host time, so the ratios show how each mode schedules this trace, not what it gains on a GPU;" \
     "on one H200 pd and mixed end level on makespan. The GPU figures, with their commit, command and" \
     "seeds, are in docs/PERF.md."

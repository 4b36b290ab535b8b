#!/usr/bin/env bash
# Issue 22: engine step logs for the rendezvous simulator (rank skew, D enqueue times, logged
# rendezvous latencies), CPU, the tiny model: `pdrollout generate --mode pd` fine-grained span 1,
# 8 requests x 24 greedy tokens, on 2 ranks (ATP2) and 4 ranks (ATP2/ADP2), each transport.
# Usage (repo root): bash e2e/rdv_steplogs.sh OUT     -> OUT/n{2,4}-{gather,dissemination}/rankN.jsonl, OUT/meta.json
set -euo pipefail
out="${1:?output dir}"
work="$(mktemp -d /tmp/pdrollout-rdvlogs.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
pdrollout checkpoint --config tiny --out "$work/tiny" >/dev/null 2>&1
python3 - "$work/reqs.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(8):
        ids = [(i * 37 + k * 11) % 500 + 2 for k in range(8 + 13 * i)]
        f.write(json.dumps({"rid": f"r{i}", "input_ids": ids, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}) + "\n")
PY
runs=()
for topo in "2 1 2" "4 2 4"; do
  set -- $topo
  for rdv in gather dissemination; do
    t0=$(date +%s.%N)
    pdrollout generate --model "$work/tiny" --requests "$work/reqs.jsonl" --mode pd --nproc "$1" --adp "$2" --ep "$3" \
      --engine-config '{"block_size": 4, "num_blocks": 512, "mixed_chunk_tokens": 20}' \
      --control '{"prefill_budget_tokens": 24, "ordering": "fine-grained", "span": 1, "activation": "on"}' \
      --rendezvous "$rdv" --step-log "$out/n$1-$rdv" > "$work/out.jsonl"
    runs+=("{\"dir\": \"n$1-$rdv\", \"nproc\": $1, \"adp\": $2, \"ep\": $3, \"rendezvous\": \"$rdv\", \"requests_done\": $(wc -l < "$work/out.jsonl"), \"wall_s\": $(python3 -c "import time; print(round(time.time() - $t0, 1))")}")
  done
done
python3 - "$out/meta.json" "$(git -C "$(dirname "$0")/.." rev-parse HEAD)$(git -C "$(dirname "$0")/.." diff --quiet HEAD -- . && echo || echo +dirty)" "$(IFS=,; echo "${runs[*]}")" <<'PY'
import json, os, platform, sys
json.dump({"command": "bash e2e/rdv_steplogs.sh OUT", "commit": sys.argv[2], "machine": {"host": platform.node(),
           "cores": os.cpu_count(), "load_avg": os.getloadavg()}, "runs": json.loads("[" + sys.argv[3] + "]")},
          open(sys.argv[1], "w"), indent=1)
PY
echo "wrote $out"

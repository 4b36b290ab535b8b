#!/usr/bin/env bash
# The decode step and the 8k prefill chunk under each opt-in kernel, one process per variant,
# side by side in one call, with a table last (`bench engine` does the timing).
# Usage (GPU machine, repo root): python -m e2e.gpu bench variants OUTDIR [NAME='ARGS'...]
#   default variants: the defaults (fused add + norm and routing in bf16), those two unfused, and
#   each opt-in kernel on top of the defaults (the decode attention in one pass, the paged prefill one).
set -uo pipefail
out="${1:?output dir}"; shift
source "$(dirname "$0")/env.sh"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/../.."   # python -m e2e.gpu finds its package from the repo root
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(
  "base="
  "unfused=--add-norm torch --router torch"
  "onepass=--kv-splits 1"
  "prefill=--prefill-attention triton"
)
for v in "${variants[@]}"; do
  name="${v%%=*}"; args="${v#*=}"
  echo "== $name: $args"
  # shellcheck disable=SC2086
  timeout "${VARIANT_TIMEOUT:-180}" python3 -m e2e.gpu bench engine $args --out "$out/$name.json" \
    > "$out/$name.log" 2>&1 || { echo "$name failed (exit $?)"; tail -5 "$out/$name.log"; }
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
every = {f.stem: json.loads(f.read_text()) for f in sorted(out.glob("*.json")) if f.stem != "summary"}
(out / "summary.json").write_text(json.dumps(every, indent=1))   # one file to bring back
rows = []
for name, d in every.items():
    p = d.get("p_forwards", {}).get("8x32", {})   # a P1-sized epoch's forward: eager / P's graphs
    rows.append((name, d["decode_replay_ms"], d["decode_replay_over_floor"], d["decode_step_ms"],
                 d["decode_ms_per_token"], d["tokens_per_row_step"], d["prefill_chunk_ms"],
                 d["prefill_fraction_of_peak"], p.get("eager_ms", float("nan")), p.get("graphed_ms", float("nan")),
                 d.get("verify_replay_ms") or float("nan")))
# tok/row: tokens per decode row and step (1 without speculation: fewer means rows sat out steps);
# verify ms: the graph a speculative step replays (replay ms is the plain decode graph's)
print(f"{'variant':<12}{'replay ms':>10}{'/floor':>8}{'step ms':>9}{'ms/tok':>8}{'tok/row':>8}{'8k ms':>8}{'of peak':>9}"
      f"{'P256 eager':>11}{'P256 graph':>11}{'verify ms':>10}")
for r in rows:
    print(f"{r[0]:<12}{r[1]:>10.2f}{r[2]:>8.3f}{r[3]:>9.2f}{r[4]:>8.2f}{r[5]:>8.2f}{r[6]:>8.1f}{r[7]:>9.3f}"
          f"{r[8]:>11.2f}{r[9]:>11.2f}{r[10]:>10.2f}")
PY

#!/usr/bin/env bash
# A set of bench/kernel/profile runs on one GPU, in parts that each fit one device call (<= 600 s), every
# part packed into OUT/PART.tgz the moment it ends: the device returns files under $OUT only to a
# shallow depth, and a call that runs out of time returns what was packed before (a fifteenth-session
# call lost a finished five-seed table that way).
#
#   COMMIT=<sha> python -m e2e.gpu bench plan OUT PART [SEEDS] [-- EXTRA bench_seeds ARGS]
#     tests          python3 -m pytest -m gpu tests/engine (exactness, compiles, graphs)
#     p1             bench_seeds at P1 over SEEDS (default 0,1,2,3,4), normal/mixed/pd, step logs,
#                    servers reused in two blocks with the mode order reversed in the second; then
#                    `report step-costs --bound` over the step logs
#     trace          the same at trace pressure (SEEDS default 0,1: ~4 min a seed)
#     decode         `bench engine` decode steps at batch 1, 8 and 64 (graph replays) beside their floors
#     profiles       the copy rate eager and graph-captured (`kernels hbm`), then `profile decode` of one decode step
#                    at batch 64 and of one 8k prefill chunk (the kernels by GPU time, wall beside them)
#     spread         identical servers on the same seeds (SEEDS default 0,1,2): two `normal`, three `mixed`
#                    and two `pd`, one block, the GPU's clocks sampled beside them; then `report step-costs --d-speed`
#                    between every pair of one mode (how far two servers of the same code differ), and
#                    `report repeats`: the modes' ratios between their median servers, per seed
#
# COMMIT is required: the device copy's `git rev-parse` has read an older HEAD than the tree it ran.
# Each part stops itself PART_BUDGET_S seconds in (default 540) so that packing always happens.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: python -m e2e.gpu bench plan OUT tests|p1|trace|decode|profiles|spread [SEEDS]}"
part="${2:?usage: python -m e2e.gpu bench plan OUT tests|p1|trace|decode|profiles|spread [SEEDS]}"
seeds="${3:-}"
shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
: "${COMMIT:?set COMMIT to the commit this tree is (the git HEAD of the device copy can lag)}"
export COMMIT MACHINE="${MACHINE:-nvidia-h200}" NCCL_NVLS_ENABLE=0
budget="${PART_BUDGET_S:-540}"
# DEVICE=cpu: a dry run here with the repo's venv (tests/engine/test_gpu_scripts_dry_run.py); the
# shim and the carried wheels are the GPU machine's
[ "${DEVICE:-}" = cpu ] || source "$here/env.sh"
# python -m e2e.gpu finds its package from the repo root (PYTHONPATH=root would shadow the stdlib's
# `operator` with the operator package): OUT made absolute, then the root is the cwd
mkdir -p "$out" && out="$(cd "$out" && pwd)"
cd "$(dirname "$(dirname "$here")")"
dir="$out/$part"
mkdir -p "$dir"
# Logs over 100 KB as they are committed (docs/perf: gzipped; the scripts read either)
pack() {
  find "$dir" -name '*.jsonl' -size +100k -exec gzip -9nf {} +
  tar -C "$out" -czf "$out/$part.tgz" "$part" && echo "[plan] packed $out/$part.tgz ($(du -h "$out/$part.tgz" | cut -f1))"
}
trap pack EXIT
started=$(date +%s)
left() { echo $(( budget - ($(date +%s) - started) )); }

seeds_runs() {  # seeds_runs PRESSURE DEFAULT_SEEDS [EXTRA bench_seeds ARGS]
  local pressure="$1" s="${seeds:-$2}" blocks=1
  shift 2
  [ "$(tr ',' '\n' <<< "$s" | wc -l)" -ge 2 ] && blocks=2
  timeout --signal=INT "$(left)" python3 -m e2e.gpu bench seeds "$dir" --seeds "$s" --pressures "$pressure" \
    --reuse-server --blocks "$blocks" --step-logs --skip-existing --variant 'base:normal,mixed,pd:{}' "$@" \
    2>&1 | tail -n 60
  python3 -m e2e.gpu bench seeds "$dir" --summarize > /dev/null 2>&1
  # P's share of each run and the bound it puts on any planner (docs/perf/HISTORY.md, sixteenth session)
  local logs=("$dir"/base/steps-*)
  [ -e "${logs[0]}" ] && python3 -m e2e.gpu report step-costs --bound --json "$dir/bounds.json" "${logs[@]}" > "$dir/bounds.txt" 2>&1
}

case "$part" in
  tests)
    timeout --signal=INT "$(left)" python3 -m pytest -m gpu tests/engine -q -p no:cacheprovider > "$dir/gpu_tests.txt" 2>&1
    tail -n 15 "$dir/gpu_tests.txt" ;;
  p1) seeds_runs P1 0,1,2,3,4 "$@" ;;
  trace) seeds_runs trace 0,1 "$@" ;;
  decode)
    for b in 1 8 64; do
      [ "$(left)" -gt 60 ] || break
      timeout --signal=INT "$(left)" python3 -m e2e.gpu bench engine --batch "$b" --ctx 2048 --steps 30 \
        --out "$dir/decode-b$b.json" > "$dir/decode-b$b.log" 2>&1
      tail -n 4 "$dir/decode-b$b.log"
    done ;;
  profiles)
    python3 -m e2e.gpu kernels hbm > "$dir/copy_bw.json" 2>&1; cat "$dir/copy_bw.json"
    timeout --signal=INT "$(left)" python3 -m e2e.gpu profile decode --batch 64 --out "$dir/profile_b64.txt" > "$dir/profile_b64.log" 2>&1
    timeout --signal=INT "$(left)" python3 -m e2e.gpu profile decode --prefill --out "$dir/profile_prefill.txt" > "$dir/profile_prefill.log" 2>&1
    tail -n 5 "$dir"/profile_*.log ;;
  spread)
    sampler=""
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv,nounits -lms 500 > "$dir/clocks.csv" 2>&1 &
      sampler=$!
    fi
    timeout --signal=INT "$(left)" python3 -m e2e.gpu bench seeds "$dir" --seeds "${seeds:-0,1,2}" --pressures P1 \
      --reuse-server --blocks 1 --step-logs --skip-existing --variant 'base:normal,mixed,pd:{}' \
      --variant 'm2:mixed:{}' --variant 'm3:mixed:{}' --variant 'q2:pd:{}' --variant 'n2:normal:{}' "$@" 2>&1 | tail -n 40
    [ -n "$sampler" ] && kill "$sampler"
    python3 -m e2e.gpu bench seeds "$dir" --summarize > /dev/null 2>&1
    for pair in base/mixed:m2/mixed base/mixed:m3/mixed m2/mixed:m3/mixed base/pd:q2/pd base/normal:n2/normal base/pd:base/mixed; do
      a="${pair%%:*}" b="${pair##*:}"
      a=("$dir/${a%/*}"/steps-"${a#*/}"-*) b=("$dir/${b%/*}"/steps-"${b#*/}"-*)
      [ -e "${a[0]}" ] && [ -e "${b[0]}" ] || continue
      echo "== ${pair%%:*} / ${pair##*:}"
      python3 -m e2e.gpu report step-costs --d-speed "${a[0]}" "${b[0]}"
    done 2>&1 | tee "$dir/d_speed.txt"
    # the modes against each other over the repeated servers (the median server of each mode)
    python3 -m e2e.gpu report repeats --json "$dir/repeats.json" "$dir/summary.json" 2>&1 | tee "$dir/repeats.md" ;;
  *) echo "unknown part $part: tests, p1, trace, decode, profiles or spread" >&2; exit 2 ;;
esac

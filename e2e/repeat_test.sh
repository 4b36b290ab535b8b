#!/usr/bin/env bash
# Run one pytest node id N times in each of C concurrent copies (a loaded CI machine), and count
# passes. Used for timing-sensitive tests (docs/DISTRIBUTED.md, issue 14: the stall exit code).
#   bash e2e/repeat_test.sh N C 'tests/distributed/test_mp_engine.py::test_isolation_only_one_slot_stalls_on_the_real_model'
set -uo pipefail
n="${1:?repetitions per copy}" copies="${2:?concurrent copies}" test="${3:?pytest node id}"
cd "$(dirname "$0")/.."
source e2e/lib/env.sh
pdrollout_venv
log="$(mktemp -d)"
t0=$SECONDS
for c in $(seq "$copies"); do
  (for i in $(seq "$n"); do
     if pytest -q -p no:cacheprovider "$test" >"$log/c$c-$i.log" 2>&1; then echo pass; else echo "FAIL c$c-$i"; fi
   done >"$log/copy$c") &
done
wait
passes=$(cat "$log"/copy* | grep -c '^pass$')
total=$((n * copies))
echo "$passes/$total passed ($copies copies at once, $((SECONDS - t0)) s); logs in $log"
grep -h FAIL "$log"/copy* || true
[ "$passes" -eq "$total" ]

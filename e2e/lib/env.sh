# Sourced by .ci/run and e2e/demo.sh: one place that makes the Python environment.
# The venv lives under the cache, keyed by Python version and the dependency list, so repeated
# runs reuse it and a fresh machine builds it once.
PDROLLOUT_CACHE="${PDROLLOUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdrollout}"
export PDROLLOUT_CACHE

pdrollout_venv() {
  local root py key
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  py="${PYTHON:-python3}"
  # Key on the declared dependencies only, so editing the package list does not rebuild the venv.
  key="$("$py" - "$root/pyproject.toml" <<'PY'
import hashlib, json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = json.dumps([p["dependencies"], p.get("optional-dependencies", {})], sort_keys=True)
print("py%d%d-%s" % (*sys.version_info[:2], hashlib.sha256(deps.encode()).hexdigest()[:12]))
PY
)"
  PDROLLOUT_VENV="$PDROLLOUT_CACHE/venv-$key"
  mkdir -p "$PDROLLOUT_CACHE"
  # One builder at a time: concurrent callers wait for the first instead of clobbering its venv.
  exec 9>"$PDROLLOUT_CACHE/venv.lock"
  flock 9
  if [ ! -x "$PDROLLOUT_VENV/.ready" ]; then
    echo "[pdrollout] creating $PDROLLOUT_VENV (first run: downloads PyTorch, a few minutes)" >&2
    rm -rf "$PDROLLOUT_VENV"
    "$py" -m venv "$PDROLLOUT_VENV"
    "$PDROLLOUT_VENV/bin/pip" install -q --upgrade pip
    "$PDROLLOUT_VENV/bin/pip" install -q "torch==2.11.0"
    "$PDROLLOUT_VENV/bin/pip" install -q -e "$root[operator,test]"
    printf '#!/bin/sh\n' > "$PDROLLOUT_VENV/.ready" && chmod +x "$PDROLLOUT_VENV/.ready"
  fi
  # Refresh the editable install only when pyproject.toml changed (e.g. a new sub-package).
  local stamp
  stamp="$(sha256sum "$root/pyproject.toml" | cut -c1-16)@$root"
  if [ "$(cat "$PDROLLOUT_VENV/.editable" 2>/dev/null)" != "$stamp" ]; then
    "$PDROLLOUT_VENV/bin/pip" install -q --no-deps -e "$root" >/dev/null 2>&1 \
      || "$PDROLLOUT_VENV/bin/pip" install --no-deps -e "$root"
    echo "$stamp" > "$PDROLLOUT_VENV/.editable"
  fi
  # Venvs of other dependency lists (~5 GB each) pile up as pyproject.toml changes: keep the one most
  # recently used beside this one (another checkout may still be on it), remove the rest.
  touch "$PDROLLOUT_VENV/.used"
  local v stamps=() stale
  for v in "$PDROLLOUT_CACHE"/venv-*/; do
    v="${v%/}"
    [ "$v" = "$PDROLLOUT_VENV" ] || stamps+=("$( [ -e "$v/.used" ] && echo "$v/.used" || echo "$v")")
  done
  if [ ${#stamps[@]} -gt 1 ]; then
    for stale in $(ls -1dt "${stamps[@]}" | tail -n +2); do
      echo "[pdrollout] removing the unused venv ${stale%/.used}" >&2
      rm -rf "${stale%/.used}"
    done
  fi
  flock -u 9
  # The venv is shared by every checkout on the machine and its editable install points at the last
  # one that refreshed it: each shell imports its own checkout's sources through a shim on
  # PYTHONPATH (searched before the editable finder), so a CI clone beside a work tree stays itself.
  mkdir -p "$root/.pdshim/pdrollout"
  ln -sfn "$root/engine" "$root/.pdshim/pdrollout/engine"
  ln -sfn "$root/operator" "$root/.pdshim/pdrollout/operator"
  export PYTHONPATH="$root/.pdshim${PYTHONPATH:+:$PYTHONPATH}"
  export PDROLLOUT_VENV
  export PATH="$PDROLLOUT_VENV/bin:$PATH"
}

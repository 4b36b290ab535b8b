#!/usr/bin/env bash
# Build the real-node mode's container images here, from Debian's and PyPI's packages only (no image
# registry): a pause image (Kubernetes' own pause.c, same version as the kubelet), the CPU engine image
# and the operator image, as layers + recipes from which start.sh streams OCI archives (oci.py) into
# `ctr image import`.
#
#   bash e2e/cluster/images.sh          # prints the image references (also in $IMAGES_DIR/refs.env)
#
# Every layer is cached under $IMAGES_DIR/layers, keyed by what went into it, so an edit to our package
# rebuilds only the small app layer; torch (the big one) is keyed by the versions it links.
#   base      debootstrap --variant=minbase of $IMAGE_SUITE + python3 (Debian's Python, same minor as ours)
#   torch     the venv's torch and what it needs (the CUDA runtime wheels it links too; not triton)
#   deps      the package's own dependencies (pyproject.toml) / the operator's pins (images/operator.Dockerfile)
#   app       our package (engine + operator) and its two commands
#   model     the tiny random checkpoint from `pdrollout checkpoint --config tiny` at /models/tiny
#   router    sglang-router (PyPI, its pin in engine/protocol/router.py): the fleet's load balancer
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
source "$here/versions.sh"
source "$root/e2e/lib/env.sh"
export PATH="$CLUSTER_PATH:$PATH"

log() { echo "[images] $(date +%H:%M:%S) $*" >&2; }
die() { echo "[images] $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "building the root filesystem (debootstrap) needs root"
bash "$here/node-deps.sh"
pdrollout_venv >&2
py="$PDROLLOUT_VENV/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check --no-warn-script-location)

mkdir -p "$IMAGES_DIR/layers"
exec 8>"$IMAGES_DIR/.lock"
flock 8  # one builder per cache; a second waits and then finds everything cached
rm -f "$IMAGES_DIR"/layers/*.tar "$IMAGES_DIR"/layers/*.tar.sha256  # layers kept as tarballs before 2026-12-07
# A failed build leaves no half-made stage behind (nor a mount debootstrap made inside one).
unmount_under() {
  awk -v d="$1" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m"; done
}
cleanup() {
  unmount_under "$IMAGES_DIR/stage."
  rm -rf "$IMAGES_DIR"/stage.* "$IMAGES_DIR"/layers/*.part
}
trap cleanup EXIT
t_all=$SECONDS
hash() { sha256sum | cut -c1-16; }

# The image's Python must be the minor version our wheels are resolved for.
pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

# layer NAME KEY FN: the layer for KEY, a tree made by `FN STAGE_DIR` unless cached, measured by oci.py;
# its descriptor's path on stdout (the tree is tarred only as an image streams into a node).
layer() {
  local name="$1" key="$2" fn="$3" tree="$IMAGES_DIR/layers/$1-$2"
  if [ ! -f "$tree.json" ]; then
    log "layer $name ($key): building"
    local t0=$SECONDS stage
    rm -rf "$IMAGES_DIR/layers/$name"-*  # older keys
    stage="$(mktemp -d "$IMAGES_DIR/stage.XXXXXX")"
    "$fn" "$stage" >&2
    unmount_under "$stage"
    mv "$stage" "$tree"
    "$py" "$here/oci.py" layer "$tree" "$tree.json" "${excludes[@]}" >/dev/null
    log "layer $name: $("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["size"] >> 20)' "$tree.json") MiB in $((SECONDS - t0)) s"
  fi
  echo "$tree.json"
}
excludes=()

# --- base: Debian root filesystem ------------------------------------------------------------------
mirror="$(apt-get indextargets --format '$(RELEASE) $(COMPONENT) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null \
  | awk -v s="$IMAGE_SUITE" '$1 == s && $2 == "main" {print $3; exit}')"
[ -n "$mirror" ] || die "no '$IMAGE_SUITE main' repository in apt's sources; the base image comes from it"
base_pkgs="python$pyver,python3,libstdc++6,libgomp1,ca-certificates"
build_base() {
  debootstrap --variant=minbase --include="$base_pkgs" "$IMAGE_SUITE" "$1" "$mirror" >"$IMAGES_DIR/debootstrap.log" 2>&1 \
    || { tail -20 "$IMAGES_DIR/debootstrap.log" >&2; die "debootstrap failed (log: $IMAGES_DIR/debootstrap.log)"; }
  chroot "$1" python3 -c 'import sys; assert "%d.%d" % sys.version_info[:2] == "'"$pyver"'", sys.version' \
    || die "$IMAGE_SUITE's python3 is not $pyver, the version the image's wheels are resolved for"
  # Our layers install to /opt/pdrollout/lib; a .pth puts it on Debian's Python path for every user.
  echo /opt/pdrollout/lib >"$1/usr/lib/python3/dist-packages/pdrollout.pth"
}
excludes=(--exclude 'dev/*' --exclude 'proc/*' --exclude 'sys/*' --exclude 'run/*' --exclude 'tmp/*'
          --exclude 'var/cache/apt/*' --exclude 'var/lib/apt/lists/*' --exclude 'var/log/*'
          --exclude 'usr/share/doc/*' --exclude 'usr/share/man/*' --exclude 'usr/share/locale/*')
base="$(layer base "$(echo "$IMAGE_SUITE $base_pkgs ${excludes[*]} pth1" | hash)" build_base)"
excludes=()

# --- pause: Kubernetes' pause.c of the kubelet's version, static ------------------------------------
k8s_src="$(cd "$here/tools" && GOTOOLCHAIN=local GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
  | "$py" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
build_pause() {
  gcc -Os -static -Wall -DVERSION="$K8S_VERSION" -o "$1/pause" "$k8s_src/build/pause/linux/pause.c"
  strip "$1/pause"
}
pause="$(layer pause "$(echo "$K8S_VERSION $(gcc -dumpfullversion)" | hash)" build_pause)"

# --- torch: the venv's own install of it (the same wheels, no second download), less triton ------------
# PyPI has no CPU-only torch for x86_64: its wheel is CUDA-built and its libraries link the CUDA runtime
# wheels (nvidia-*), so those come along (unused on a CPU). Triton is only for GPU kernels and never
# imported on a CPU, so it stays out. The files are hard links into the venv (copies across file
# systems): the layer's 4 GB tree costs no disk of its own.
torch_closure() {  # torch_closure [DEST]: torch and what it needs here, as name==version; with DEST, linked there
  "$py" - "$@" <<'PY'
import os, shutil, sys
from importlib.metadata import distribution
from packaging.requirements import Requirement

todo, seen, done = [("torch", ())], {}, set()
while todo:                      # requirements with the extras they were asked with (cuda-toolkit[cudart,...])
    want, extras = todo.pop()
    d = distribution(want)
    name = d.metadata["Name"].lower().replace("_", "-")
    seen[name] = d
    for extra in ("", *extras):
        if (name, extra) in done:
            continue
        done.add((name, extra))
        for r in map(Requirement, d.requires or []):
            if r.name != "triton" and (r.marker is None or r.marker.evaluate({"extra": extra})):
                todo.append((r.name, tuple(r.extras)))
for name in sorted(seen):
    print(f"{name}=={seen[name].version}")
if len(sys.argv) > 1:
    dest = sys.argv[1]
    for d in seen.values():
        for f in d.files or []:
            rel = os.path.normpath(str(f))
            if rel.startswith(".."):       # console scripts: the venv's bin/, not the library
                continue
            src, dst = str(f.locate()), os.path.join(dest, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
PY
}
build_torch() { torch_closure "$1/opt/pdrollout/lib" >/dev/null; }
torch="$(layer torch "$( (torch_closure; echo "py$pyver") | hash)" build_torch)"

# --- the package's dependencies (engine) and the operator's pins -----------------------------------
mapfile -t engine_deps < <("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    if not d.startswith("torch"):
        print(d)
PY
)
build_engine_deps() { "${pip[@]}" --target "$1/opt/pdrollout/lib" "${engine_deps[@]}"; }
edeps="$(layer engine-deps "$(echo "${engine_deps[*]} py$pyver" | hash)" build_engine_deps)"

# One list of operator pins: the ones images/operator.Dockerfile installs.
mapfile -t operator_pins < <(grep -o '"[A-Za-z0-9_.-]*==[^"]*"' "$root/images/operator.Dockerfile" | tr -d '"')
[ ${#operator_pins[@]} -gt 0 ] || die "found no pinned packages in images/operator.Dockerfile"
build_operator_deps() { "${pip[@]}" --target "$1/opt/pdrollout/lib" "${operator_pins[@]}"; }
odeps="$(layer operator-deps "$(echo "${operator_pins[*]} py$pyver" | hash)" build_operator_deps)"

# --- our package ------------------------------------------------------------------------------------
src_key="$(cd "$root" && find pyproject.toml engine operator -type f -not -path '*/__pycache__/*' -print0 \
  | sort -z | xargs -0 sha256sum | hash)"
build_app() {
  local s="$1" t
  t="$(mktemp -d)"
  # A copy of just the package sources, so a work tree's build/ or egg-info never leaks in.
  cp -r "$root/pyproject.toml" "$root/README.md" "$root/engine" "$root/operator" "$t/"
  "${pip[@]}" --no-deps --target "$s/opt/pdrollout/lib" "$t"
  rm -rf "$t" "$s/opt/pdrollout/lib/bin"  # pip's scripts name the build machine's interpreter
  mkdir -p "$s/usr/local/bin"
  # The guard matters: the engine's rank processes start from multiprocessing's forkserver, which imports
  # this script again as __mp_main__; without it every rank ran `main()` (a second server) anew.
  local cmd mod
  for cmd in pdrollout=pdrollout.engine.cli pdrollout-operator=pdrollout.operator.__main__; do
    mod="${cmd#*=}"
    printf '#!/usr/bin/python3\nimport sys\nfrom %s import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
      "$mod" >"$s/usr/local/bin/${cmd%%=*}"
  done
  chmod 755 "$s/usr/local/bin/"*
}
# Keyed by the recipe too (declare -f): a change to how the layer is made rebuilds it.
app="$(layer app "$( (echo "$src_key"; declare -f build_app) | hash)" build_app)"

build_model() { "$PDROLLOUT_VENV/bin/pdrollout" checkpoint --config tiny --out "$1/models/tiny" --seed 0 >/dev/null; }
model="$(layer model "$src_key" build_model)"

# --- the router: PyPI's sglang-router wheel (a Rust binary under a Python launcher) and what it needs --
router_pin="sglang-router==$("$py" -c 'import runpy, sys; print(runpy.run_path(sys.argv[1])["SGLANG_ROUTER_VERSION"])' \
  "$root/engine/protocol/router.py")"
build_router() { "${pip[@]}" --target "$1/opt/pdrollout/lib" "$router_pin"; }
router="$(layer router "$(echo "$router_pin py$pyver" | hash)" build_router)"

# --- images -----------------------------------------------------------------------------------------
version="$("$py" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$root/pyproject.toml")"
env_py='["PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"]'
# The CPU engine's pods share this machine's cores with each other and the tests: one OpenMP thread a
# process, as in the tests' own processes (tests/conftest.py says why).
env_engine="${env_py%]}, \"OMP_NUM_THREADS=1\"]"
# image NAME CONFIG_JSON LAYER...: the image's recipe (name, config, layers), from which start.sh streams
# the OCI archive into each node's containerd (no multi-GB archive on disk); prints NAME:TAG RECIPE.
image() {
  local name="$1" cfg="$2"; shift 2
  local key ref out
  key="$( (echo "$cfg"; cat "$@") | hash)"
  ref="pdrollout.local/$name:$version-${key:0:12}"
  case "$name" in *:*) ref="pdrollout.local/$name"; name="${name%%:*}" ;; esac  # NAME:TAG: a fixed tag
  out="$IMAGES_DIR/$name.image.json"
  "$py" - "$ref" "$cfg" "$out" "$@" <<'PY'
import json, sys
ref, cfg, out, *layers = sys.argv[1:]
json.dump({"name": ref, "config": json.loads(cfg), "layers": layers}, open(out, "w"), indent=1)
PY
  printf '%s %s\n' "$ref" "$out"
}
read -r pause_ref pause_recipe < <(image pause \
  '{"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/pause"], "User": "65535:65535"}}' "$pause")
read -r op_ref op_recipe < <(image operator '{"architecture": "amd64", "os": "linux", "config": {
  "Entrypoint": ["pdrollout-operator"], "Cmd": ["--liveness=http://0.0.0.0:8080/healthz"],
  "Env": '"$env_py"', "User": "65532:65532", "ExposedPorts": {"8080/tcp": {}}}}' "$base" "$odeps" "$app")
read -r eng_ref eng_recipe < <(image engine-cpu '{"architecture": "amd64", "os": "linux", "config": {
  "Entrypoint": ["pdrollout"], "Cmd": ["serve", "--help"], "Env": '"$env_engine"',
  "ExposedPorts": {"30000/tcp": {}, "29500/tcp": {}}}}' "$base" "$torch" "$edeps" "$app" "$model")
# The router's tag is its release (ROUTER_IMAGE in engine/protocol/router.py, the operator's default).
read -r router_ref router_recipe < <(image "pdrollout-router:${router_pin#*==}" '{"architecture": "amd64", "os": "linux",
  "config": {"Entrypoint": ["python3", "-m", "sglang_router.launch_router"], "Env": '"$env_py"',
  "User": "65532:65532", "ExposedPorts": {"30000/tcp": {}, "29000/tcp": {}}}}' "$base" "$router")

# The layer digests: a node keeps only the unpacked snapshots after importing (half the disk).
layers="$("$py" -c 'import json, sys; print(" ".join(json.load(open(p))["digest"] for p in sys.argv[1:]))' \
  "$base" "$pause" "$torch" "$edeps" "$odeps" "$app" "$model" "$router")"
cat >"$IMAGES_DIR/refs.env" <<EOF
PAUSE_IMAGE=$pause_ref
PAUSE_RECIPE=$pause_recipe
OPERATOR_IMAGE=$op_ref
OPERATOR_RECIPE=$op_recipe
ENGINE_IMAGE=$eng_ref
ENGINE_RECIPE=$eng_recipe
ENGINE_MODEL=/models/tiny
ROUTER_IMAGE=$router_ref
ROUTER_RECIPE=$router_recipe
LAYER_DIGESTS="$layers"
EOF
log "images ready in $((SECONDS - t_all)) s ($IMAGES_DIR/refs.env)"
cat "$IMAGES_DIR/refs.env"

#!/usr/bin/env bash
# Fills .whl/ with what the GPU machine's python3 (3.12, no network there) lacks: pydantic and its
# dependencies, and py-spy (a native-stack profiler for the server's threads). env.sh installs them
# there; the device call carries .whl/ (ignored by git).
# Usage (this machine, repo root): bash e2e/gpu/wheels.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$root/.whl"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$root/.whl" \
  "pydantic>=2.7" py-spy
ls "$root/.whl"

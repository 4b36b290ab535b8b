# Sourced on the GPU machine (its python3 already has torch, triton, transformers, aiohttp,
# prometheus_client): installs carried wheels (.whl/, e.g. pydantic) and makes `pdrollout.*`
# importable from this checkout without pip (nothing can be fetched there).
set -e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl
fi
mkdir -p /tmp/pdshim/pdrollout
ln -sfn "$ROOT/engine" /tmp/pdshim/pdrollout/engine
ln -sfn "$ROOT/operator" /tmp/pdshim/pdrollout/operator
export PYTHONPATH="/tmp/pdshim:/tmp/site:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The __main__ guard matters: ranks start from a forkserver, which re-imports this script as the
# children's main module; without the guard every rank would run the command again.
cat > /tmp/pdshim/pdrollout_cli <<PY
#!/usr/bin/env python3
import sys
from pdrollout.engine.cli import main
if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x /tmp/pdshim/pdrollout_cli
mkdir -p /tmp/pdshim/bin && ln -sfn /tmp/pdshim/pdrollout_cli /tmp/pdshim/bin/pdrollout
export PATH="/tmp/pdshim/bin:/tmp/site/bin:$PATH"   # /tmp/site/bin: carried tools (py-spy)
set +e

"""The RL frameworks' released packages, as the tests' clients: SGLang (its weight-sync helpers and
bench_serving), AReaL and verl from PyPI, in one side venv beside ours (tests/side_venv.py):
sglang, areal and verl without their dependencies, plus what their imports reach that our venv
lacks (found by importing them; ~700 MB, ~1 min, built once under
${PDROLLOUT_CACHE:-~/.cache/pdrollout}/rl-clients-<hash of the pins>-on-<our venv>). slime is not on PyPI: its calls are data
read from its source (tests/rl_framework_calls.py).

What imports without a GPU (checked by `test_rl_clients_import`): SGLang's
`sglang.srt.utils.init_custom_process_group`, `MultiprocessingSerializer`,
`sglang.srt.weight_sync.utils.update_weights` and `FlattenedTensorBucket`; AReaL's
`areal.engine.sglang_remote` (RemoteSGLangEngine, SGLangBackend) and
`areal.engine.core.distributed.init_custom_process_group`; verl's
`verl.workers.rollout.sglang_rollout.http_server_engine.AsyncHttpServerAdapter`. What does not:
see NOT_IMPORTED."""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from side_venv import SideVenvError, side_venv

SGLANG = "sglang==0.5.23"
AREAL = "areal==1.0.4"
VERL = "verl==0.9.1"
# Installed without dependencies beside sglang, areal and verl: what their imports reach that our
# venv lacks. torchvision is the release paired with our torch.
IMPORTS = (
    # sglang (sglang.srt, bench_serving)
    "apache-tvm-ffi==0.1.15.post2", "asttokens==3.0.2", "compressed-tensors==0.20.1", "datasets==5.2.0",
    "dill==0.4.1", "executing==2.3.0", "gguf==0.19.0", "ipython==9.19.1", "ipython-pygments-lexers==1.1.1",
    "jedi==0.20.1", "loguru==0.7.3", "matplotlib-inline==0.2.2", "msgspec==0.23.0", "multiprocess==0.70.19",
    "orjson==3.13.0", "pandas==3.1.1", "parso==0.8.7", "pexpect==4.9.0", "prompt-toolkit==3.0.53",
    "psutil==7.2.2", "ptyprocess==0.7.0", "pure-eval==0.2.4", "pyarrow==26.0.1", "pybase64==1.5.1",
    "pyzmq==27.3.0", "sentencepiece==0.2.3", "stack-data==0.6.3", "starlette==1.10.0", "torchvision==0.26.0",
    "traitlets==5.16.1", "wcwidth==0.9.5", "xxhash==4.1.0",
    # areal (areal.engine.sglang_remote, areal.infra) and verl (its SGLang HTTP adapter)
    "aiofiles==25.1.0", "antlr4-python3-runtime==4.9.3", "blinker==1.9.0", "cffi==2.1.1", "cloudpickle==3.1.3",
    "codetiming==1.4.0", "colorlog==6.12.0", "einops==0.8.2", "fastapi==0.165.0", "flask==3.1.3",
    "hydra-core==1.3.8", "itsdangerous==2.2.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1",
    "lark==1.3.1", "llvmlite==0.50.0", "msgpack==1.2.4", "numba==0.68.1", "omegaconf==2.4.0",
    "opentelemetry-api==1.45.3", "partial-json-parser==0.2.1.1.post7", "protobuf==7.36.2", "pycparser==3.12",
    "python-multipart==0.0.34", "pyvers==0.2.3", "ray==2.60.0", "referencing==0.37.0", "rpds-py==2026.9.1", "setproctitle==1.3.8",
    "soundfile==0.14.0", "tenacity==9.2.1", "tensordict==0.15.3", "torchdata==0.11.0", "uvicorn==0.55.0",
    "uvloop==0.23.0", "werkzeug==3.1.9", "xgrammar==0.2.9")

# The parts of the frameworks' trainer side that need a GPU, a cluster or a launcher to import or to
# construct; the tests replay these parts' exact bodies (tests/rl_framework_calls.py names the source).
NOT_IMPORTED = {
    "slime": "not on PyPI; its Megatron actors and Ray-launched SGLangEngine need megatron-core and GPUs",
    "areal": "FSDPEngine / MegatronEngine (the trainer's update_weights: CUDA, an FSDP or Megatron mesh); "
             "the HTTP side (RemoteSGLangEngine) imports and runs",
    "verl": "ServerAdapter (verl.workers.rollout.sglang_rollout.sglang_rollout: constructed only in a Ray "
            "worker, with a server actor it looks up by name and verl's RolloutConfig) and its HTTP adapter "
            "AsyncHttpServerAdapter, which imports but does not construct on sglang 0.5.23 (begin_weight_update "
            "and end_weight_update are abstract there) while verl's own pin, sglang 0.5.12, does not import "
            "without sgl_kernel (CUDA); the adapter's update_weights_from_tensor body is replayed as data, "
            "SGLang's update_weights it calls runs as released",
}
HERE = Path(__file__).resolve().parent
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def clients_venv() -> Path:
    """The side venv's directory (built on first use); a venv that cannot be built fails the test."""
    try:
        pins = hashlib.sha256(" ".join((SGLANG, AREAL, VERL, *IMPORTS)).encode()).hexdigest()[:8]
        return side_venv(f"rl-clients-{pins}", SGLANG, 900, beside_ours=(AREAL, VERL, *IMPORTS))
    except SideVenvError as e:
        pytest.fail(str(e))


def python() -> str:
    return str(clients_venv() / "bin" / "python")


def run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """One of tests/rl_*.py under the clients' python, tests/ on its path, to its exit. Its output goes
    through files, not pipes: a torch_shm_manager it started (CPU tensors shared by name) outlives it
    holding what it inherited, and a pipe would not reach its end until that daemon does."""
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.run([python(), str(HERE / script), *args], stdout=out, stderr=err, text=True,
                           timeout=timeout, env=env)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())


def popen(script: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([python(), str(HERE / script), *args], env=env, text=True, **kw)

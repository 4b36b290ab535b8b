"""`sglang.bench_serving` (PyPI `sglang`) as an external client against our server.

sglang pins its own torch (and CUDA wheels, ~11 GB), so it lives in a side venv under
${PDROLLOUT_CACHE:-~/.cache/pdrollout}/sglang-bench-<version>-on-<our venv> that sees our venv's torch and
transformers and adds only what `sglang.bench_serving`'s imports need beyond them (BENCH_IMPORTS, found
by running it; ~600 MB, ~1 min), built once and reused.
bench_serving needs a Hugging Face tokenizer: it builds text prompts from a dataset and counts
output tokens from the streamed `text`. We write a local word-level tokenizer over the tiny
model's 512-token vocabulary and give the same one to the server (`--tokenizer`), so no hub
access is needed; `--dataset-path` points `random` at a local ShareGPT-shaped file.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from side_venv import SideVenvError, side_venv

SGLANG_VERSION = "0.5.23"
# Installed without dependencies beside sglang: what importing sglang.bench_serving reaches (it goes
# through sglang.srt) that our venv lacks. torchvision is the release paired with our torch.
BENCH_IMPORTS = ("apache-tvm-ffi==0.1.15.post2", "asttokens==3.0.2", "compressed-tensors==0.20.1", "datasets==5.2.0",
                 "dill==0.4.1", "executing==2.3.0", "gguf==0.19.0", "ipython==9.19.1", "ipython-pygments-lexers==1.1.1",
                 "jedi==0.20.1", "loguru==0.7.3", "matplotlib-inline==0.2.2", "msgspec==0.23.0", "multiprocess==0.70.19",
                 "orjson==3.13.0", "pandas==3.1.1", "parso==0.8.7", "pexpect==4.9.0", "prompt-toolkit==3.0.53",
                 "psutil==7.2.2", "ptyprocess==0.7.0", "pure-eval==0.2.4", "pyarrow==26.0.1", "pybase64==1.5.1",
                 "pyzmq==27.3.0", "sentencepiece==0.2.3", "stack-data==0.6.3", "starlette==1.10.0", "torchvision==0.26.0",
                 "traitlets==5.16.1", "wcwidth==0.9.5", "xxhash==4.1.0")
VOCAB = 512
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _sglang_venv() -> Path:
    try:
        return side_venv(f"sglang-bench-{SGLANG_VERSION}", f"sglang=={SGLANG_VERSION}", 900, beside_ours=BENCH_IMPORTS)
    except SideVenvError as e:
        pytest.fail(str(e))


def _word_tokenizer(out: Path) -> Path:
    """token id i <-> word `tNNN` (fixed width: no word is a prefix of another)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir()
    tok = Tokenizer(models.WordLevel({f"t{i:03d}": i for i in range(VOCAB)}, unk_token="t002"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
        "unk_token": "t002", "bos_token": "t000", "eos_token": "t001"}))
    return out


def _sharegpt(path: Path) -> Path:
    convs = [{"conversations": [{"from": "human", "value": " ".join(f"t{(7 * i + j) % 500 + 10:03d}" for j in range(40))},
                                {"from": "gpt", "value": "t011 t012"}]} for i in range(16)]
    path.write_text(json.dumps(convs))
    return path


def _counter(server, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in fam.samples:
            if s.name == name and (labels is None or s.labels == labels):
                return s.value
    return 0.0


def test_sglang_bench_serving_against_our_server(start_server, tmp_path):
    venv = _sglang_venv()
    tok = _word_tokenizer(tmp_path / "tok")
    srv = start_server("--tokenizer", str(tok))
    gen_before = _counter(srv, "pdrollout:generation_tokens_total")
    out = tmp_path / "bench.jsonl"
    num_prompts = 8
    cmd = [str(venv / "bin" / "python"), "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", srv.url, "--dataset-name", "random", "--dataset-path", str(_sharegpt(tmp_path / "sg.json")),
           "--num-prompts", str(num_prompts), "--random-input-len", "32", "--random-output-len", "8",
           "--tokenizer", str(tok), "--output-file", str(out), "--seed", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                       env={**os.environ, **OFFLINE})
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}\n{srv.log[-3000:]}"
    res = json.loads(out.read_text().splitlines()[-1])
    assert res["completed"] == num_prompts
    assert res["total_output_tokens"] > 0
    # The streamed text decodes back to exactly the tokens we generated.
    assert res["total_output_tokens_retokenized"] == res["total_output_tokens"]
    assert 0 < res["median_ttft_ms"] <= res["median_e2e_latency_ms"]
    # Every token bench_serving counted came out of our engine (plus its warm-up request).
    assert _counter(srv, "pdrollout:generation_tokens_total") - gen_before >= res["total_output_tokens"]
    assert _counter(srv, "pdrollout:requests_total", {"finish_reason": "length"}) >= num_prompts
    assert srv.stop() == 0

"""Offline generation over the Engine: JSONL requests in, one JSON result per request, in order."""
from __future__ import annotations

import json
import sys
from typing import Iterable, Iterator

from ..scheduler.request import RequestError, SamplingParams
from .engine import Engine

_REQUEST_KEYS = {"input_ids", "sampling_params", "return_logprob", "rid", "rollout_id", "priority"}


def read_requests(path: str) -> list[str]:
    f = sys.stdin if path == "-" else open(path)
    with f:
        return [line for line in f if line.strip()]


def _parse(line: str, index: int):
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise RequestError(f"line {index + 1}: not valid JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise RequestError(f"line {index + 1}: a request must be a JSON object")
    unknown = set(d) - _REQUEST_KEYS
    if unknown:
        raise RequestError(f"line {index + 1}: unknown field(s) {', '.join(sorted(unknown))}")
    p = d.get("priority", 0)
    if isinstance(p, bool) or not isinstance(p, int):
        raise RequestError(f"line {index + 1}: priority must be an integer, got {p!r}")
    return d


def _result(outs: list, index: int, rid: str) -> dict:
    ids = [t for o in outs for t in o.new_token_ids]
    last = outs[-1]
    meta = {"id": rid, "finish_reason": last.finish_reason, "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens, **last.spec_meta()}
    if last.new_logprobs is not None:
        meta["output_token_logprobs"] = [[lp, t, None] for o in outs for lp, t in zip(o.new_logprobs, o.new_token_ids)]
    return {"index": index, "output_ids": ids, "meta_info": meta}


def run_requests(engine: Engine, lines: Iterable[str], sequential: bool = False) -> Iterator[dict]:
    """Yields results in input order; a bad request yields {"index", "error"} and the rest run."""
    results: dict[int, dict] = {}
    parts: dict[str, list] = {}
    index_of: dict[str, int] = {}
    pending = list(enumerate(lines))

    def drain():
        while engine.has_unfinished():
            for o in engine.step():
                parts.setdefault(o.rid, []).append(o)
                if o.finished:
                    results[index_of[o.rid]] = _result(parts.pop(o.rid), index_of[o.rid], o.rid)

    for i, line in pending:
        try:
            d = _parse(line, i)
            rid = str(d.get("rid") or f"req-{i}")
            engine.submit(rid, d.get("input_ids"), SamplingParams.from_dict(d.get("sampling_params")),
                          bool(d.get("return_logprob", False)), d.get("rollout_id"), priority=d.get("priority", 0))
            index_of[rid] = i
        except RequestError as e:
            results[i] = {"index": i, "error": str(e)}
        if sequential:
            drain()
    drain()
    for i, _ in pending:
        yield results[i]

"""Closed-loop replay of a trace against a running server over HTTP (SGLang native API).

Turn k+1 of a session is released only after turn k completed plus its client wait (scaled by the
pressure point). Its input is the session's whole context so far (earlier inputs and the server's
own output ids, then the new synthetic tokens), so prefix reuse does the rest. `ignore_eos` and
the trace's output lengths make every system do exactly the same work.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Callable

import aiohttp
import numpy as np

from ..protocol.router import ROUTING_KEY_HEADER
from .measures import BenchError, RequestRecord, metric_sums, summarize
from .trace import PRESSURE, PRIORITY_HINTS, sessions, work_left

_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)
WATCH_S = 0.5                                   # how often the replay checks that its server lives
# A killed server's sockets close before its process can be reaped: a request failing for that
# reason may reach us before the server reads as exited
DEATH_GRACE_S = 3.0

# The signal the CLI's handler received. Its KeyboardInterrupt can be raised inside a finalizer
# (aiohttp's ClientResponse.__del__), where Python prints and drops it; the replay's watcher raises
# it as Interrupted, so a signal is never lost.
pending_signal: list[int] = []


class Interrupted(Exception):
    """A signal's KeyboardInterrupt was dropped; args[0] is the signal."""


def interrupt(signum: int, _frame=None) -> None:
    """SIGTERM/SIGINT handler: unwind, so the server of the mode running is stopped too."""
    pending_signal.append(signum)
    raise KeyboardInterrupt(signum)


def synthetic_ids(seed: int, session_index: int, turn: int, n: int, vocab_size: int) -> list[int]:
    """The new tokens of one turn: deterministic in (seed, session, turn)."""
    rng = np.random.default_rng([seed, session_index, turn])
    return rng.integers(0, vocab_size, size=n).tolist()


def _sse_events(buf: bytearray):
    """Pop complete SSE `data:` payloads (bytes) from buf."""
    while True:
        cut = buf.find(b"\n\n")
        if cut < 0:
            return
        event = bytes(buf[:cut])
        del buf[:cut + 2]
        data = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if data:
            yield b"\n".join(data)


class Replay:
    """One bench run: a closed loop per session over one aiohttp client session."""

    def __init__(self, url: str, rows: list[dict], *, pressure: str = "trace", seed: int = 0,
                 rollout_id: str | None = None, progress: bool = True, priority: str = "none",
                 watch: Callable[[], str | None] | None = None):
        if pressure not in PRESSURE:
            raise BenchError(f"unknown pressure {pressure!r}; choose one of {', '.join(PRESSURE)}")
        if priority not in PRIORITY_HINTS:
            raise BenchError(f"unknown priority hint {priority!r}; choose one of {', '.join(PRIORITY_HINTS)}")
        self.priority = priority
        self.watch = watch          # the server's death, as a message (servers.Live.died)
        self.url = url.rstrip("/")
        self.sessions = sessions(rows)
        self.wait_scale = PRESSURE[pressure]
        self.seed = seed
        self.rollout_id = rollout_id or f"bench-{uuid.uuid4().hex[:12]}"
        self.progress = progress
        self.records: list[RequestRecord] = []
        self._t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    async def _watch(self) -> None:
        """Fail the replay as soon as the server it started has died (requests would wait out their
        timeouts on a server whose ranks are gone)."""
        while True:
            if pending_signal:
                raise Interrupted(pending_signal[0])
            died = self.watch() if self.watch is not None else None
            if died:
                raise BenchError(died)
            await asyncio.sleep(WATCH_S)

    async def _get(self, http, path: str) -> tuple[int, str]:
        async with http.get(self.url + path) as resp:
            return resp.status, await resp.text()

    async def model_info(self, http) -> dict:
        status, body = await self._get(http, "/get_model_info")
        if status != 200:
            raise BenchError(f"GET /get_model_info -> {status}: {body[:200]}")
        info = json.loads(body)
        if not isinstance(info.get("vocab_size"), int) or info["vocab_size"] < 2:
            raise BenchError(f"/get_model_info has no usable vocab_size: {body[:200]}")
        return info

    async def scrape(self, http) -> dict[str, float]:
        status, body = await self._get(http, "/metrics")
        return metric_sums(body) if status == 200 else {}

    async def _generate(self, http, rid: str, ids: list[int], out_len: int, priority: int | None = None,
                        session: str = "") -> dict:
        """POST /generate with stream=true; returns first-token time, output ids and meta_info. The
        session is the routing key: behind sglang-router's manual policy its turns stay on one engine."""
        payload = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0},
            "stream": True,
            "rollout_id": self.rollout_id,
        }
        if priority is not None:
            payload["priority"] = priority
        first, cum, cat, meta = None, [], [], {}
        async with http.post(self.url + "/generate", json=payload, headers={ROUTING_KEY_HEADER: session}) as resp:
            if resp.status != 200:
                raise BenchError(f"POST /generate {rid} -> {resp.status}: {(await resp.text())[:300]}")
            buf, done = bytearray(), False
            async for chunk in resp.content.iter_any():
                buf += chunk.replace(b"\r\n", b"\n")
                for data in _sse_events(buf):
                    if data == b"[DONE]":
                        done = True
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        raise BenchError(f"/generate {rid} streamed an error: {msg['error']}")
                    got = msg.get("output_ids") or []
                    if got and first is None:
                        first = self.now()
                    if got:  # SGLang streams cumulative ids; some servers send only new ones
                        cum = got
                        cat += got
                    meta = msg.get("meta_info", meta)
                if done:
                    break
        n = meta.get("completion_tokens", len(cum))
        return {"first": first, "ids": cum if len(cum) == n else cat, "meta": meta}

    async def _session(self, http, index: int, turns: list[dict], bar) -> None:
        context: list[int] = []
        prev_done = None
        for k, row in enumerate(turns):
            left = work_left(turns, k) if self.priority == "critical-path" else None
            if prev_done is not None:
                ready = prev_done + row.get("delay_ms", 0) * self.wait_scale / 1000.0
                await asyncio.sleep(max(0.0, ready - self.now()))
            ids = context + synthetic_ids(self.seed, index, row["turn"], row["input_length"],
                                          self.vocab_size)
            rid = f"{self.rollout_id}-{row['session_id']}-{row['turn']}"
            release = self.now()
            res = await self._generate(http, rid, ids, row["output_length"], left, str(row["session_id"]))
            done = self.now()
            meta = res["meta"]
            reason = (meta.get("finish_reason") or {}).get("type")
            n_out = int(meta.get("completion_tokens", len(res["ids"])))
            if n_out != row["output_length"] or len(res["ids"]) != n_out or reason == "abort":
                raise BenchError(
                    f"{rid}: asked for exactly {row['output_length']} tokens (ignore_eos), got "
                    f"{n_out} ({len(res['ids'])} ids streamed), finish_reason={reason}")
            n_in = int(meta.get("prompt_tokens", len(ids)))
            if n_in != len(ids):
                raise BenchError(f"{rid}: sent {len(ids)} input tokens, server counted {n_in}")
            self.records.append(RequestRecord(
                session_id=row["session_id"], turn=row["turn"], wait_start_s=prev_done,
                release_s=release, first_token_s=res["first"], done_s=done,
                prompt_tokens=n_in, completion_tokens=n_out,
                cached_tokens=int(meta.get("cached_tokens", 0) or 0), finish_reason=reason,
                served_by=meta.get("served_by"),
                **{k: int(meta[k]) for k in ("spec_verify_ct", "spec_proposed_drafts", "spec_accepted_drafts")
                   if meta.get(k) is not None},
                output_ids=res["ids"]))
            context = ids + res["ids"]
            prev_done = done
            if bar is not None:
                bar.update(1)

    async def run(self) -> dict:
        """Replay the whole trace; returns the summary (records stay on self.records)."""
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=_TIMEOUT) as http:
            self.vocab_size = (await self.model_info(http))["vocab_size"]
            before = await self.scrape(http)
            bar = None
            if self.progress:
                from tqdm import tqdm
                bar = tqdm(total=sum(len(t) for t in self.sessions.values()), unit="req",
                           desc="replay", leave=False)
            self._t0 = time.perf_counter()
            tasks = [asyncio.create_task(self._session(http, i, turns, bar))
                     for i, turns in enumerate(self.sessions.values())]
            everything = asyncio.ensure_future(asyncio.gather(*tasks))
            watcher = asyncio.create_task(self._watch())    # ends only by raising
            try:
                await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher.done():
                    watcher.result()    # the server died: BenchError with its log's tail
                await everything
            finally:
                for t in (*tasks, watcher, everything):
                    t.cancel()
                if bar is not None:
                    bar.close()
            # Close the rollout so the server exports its makespan; older servers may lack it.
            async with http.post(self.url + "/rollout/finish",
                                 json={"rollout_id": self.rollout_id}) as resp:
                await resp.read()
            after = await self.scrape(http)
        self.records.sort(key=lambda r: (r.release_s, r.session_id))
        return summarize(self.records, before, after)


def replay(url: str, rows: list[dict], **kw) -> tuple[dict, list[RequestRecord]]:
    """Synchronous entry point: (summary, records)."""
    r = Replay(url, rows, **kw)
    try:
        summary = asyncio.run(r.run())
    except (aiohttp.ClientError, asyncio.TimeoutError, BenchError) as e:
        died = _died_within(r.watch, DEATH_GRACE_S)
        if died:    # a request that failed because the server died: say that, with its log
            raise BenchError(died) from e
        if isinstance(e, BenchError):
            raise
        raise BenchError(f"HTTP to {url} failed: {type(e).__name__}: {e}") from e
    return summary, r.records


def _died_within(watch: Callable[[], str | None] | None, grace_s: float) -> str | None:
    """What `watch` says of the server's death, once it reads as dead within `grace_s` (None: alive)."""
    if watch is None:
        return None
    end = time.monotonic() + grace_s
    while (died := watch()) is None and time.monotonic() < end:
        time.sleep(0.05)
    return died


def speculation_of(url: str) -> dict:
    """Which speculation and weights the server ran (its /get_model_info), for the results: off, or the
    proposer and k; the weights' format (block-FP8 or a dtype)."""
    import json
    import urllib.request
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/get_model_info", timeout=10) as resp:
            info = json.loads(resp.read())
    except (OSError, ValueError) as e:
        raise BenchError(f"GET {url}/get_model_info failed: {e}") from e
    return {"speculative": info.get("speculative") or "off", "speculative_k": info.get("speculative_k", 0),
            "weights": info.get("weights", "unknown")}


def run_bench(rows: list[dict], out_dir: str, *, modes: list[str] | None = None,
              model: str | None = None, url: str | None = None, device: str | None = None,
              pressure: str = "trace", seed: int = 0, progress: bool = True,
              serve_args: tuple[str, ...] = (), meta: dict | None = None,
              priority: str = "none", repeats: int = 1, plots: bool = True) -> dict[str, dict]:
    """Bench each mode on a fresh server (or the one at `url`), write results and (unless not
    `plots`) plots.

    `repeats` > 1: every mode on that many fresh servers, in rounds whose mode order is reversed
    every other round (a drift over the run falls on every mode alike); each mode's median server
    (the lower one of an even count) stands for it in the table and plots, and results.json's
    `repeats` holds every server's makespan and the ratios between the modes' medians. Identical
    servers on one GPU end up to ~7 % apart (docs/PERF.md, "How to read these figures"), more than pd and
    mixed differ."""
    import os

    from .fleet import format_groups
    from .measures import check_same_work, format_repeats, format_table, repeat_spread
    from .report import write_plots, write_results
    from .servers import serve
    from .trace import stats

    os.makedirs(out_dir, exist_ok=True)
    expected = stats(rows)
    if not url and not (model and modes):
        raise BenchError("bench needs --url, or --model and at least one mode")
    if repeats < 1 or (url and repeats > 1):
        raise BenchError(f"repeats {repeats}: at least 1, and above 1 only with fresh servers (--model, not --url)")
    labels = [modes[0] if modes else "server"] if url else list(modes)
    runs: dict[str, list[tuple[dict, list[RequestRecord]]]] = {m: [] for m in labels}
    for r in range(repeats):
        for mode in (labels if r % 2 == 0 else labels[::-1]):
            run = mode if repeats == 1 else f"{mode}-r{r}"   # names this server's logs and records
            print(f"[bench] {'mode ' + mode if repeats == 1 else f'mode {mode}, server {r + 1} of {repeats}'}: "
                  f"{expected['requests']} requests in {expected['conversations']} sessions, pressure {pressure}",
                  flush=True)
            if url:
                summary, recs = replay(url, rows, pressure=pressure, seed=seed, progress=progress, priority=priority)
                summary.update(speculation_of(url))
            else:
                log = os.path.join(out_dir, f"server-{run}.log")
                # "{mode}" in a serve arg names the mode, "{run}" this server (e.g. a --step-log directory)
                extra = tuple(a.replace("{mode}", mode).replace("{run}", run) for a in serve_args)
                with serve(model, mode, log, device=device, extra_args=extra) as live:
                    summary, recs = replay(live.url, rows, pressure=pressure, seed=seed,
                                           progress=progress, priority=priority, watch=live.died)
                    summary.update(speculation_of(live.url))
            if (summary["total_input_tokens"], summary["total_output_tokens"]) != (
                    expected["input_tokens"], expected["output_tokens"]):
                raise BenchError(f"mode {mode}: server counted {summary['total_input_tokens']} input /"
                                 f" {summary['total_output_tokens']} output tokens; the trace has "
                                 f"{expected['input_tokens']} / {expected['output_tokens']}")
            summary.update(mode=mode, pressure=pressure, **({"repeat": r} if repeats > 1 else {}))
            runs[mode].append((summary, recs))
            print(f"[bench] mode {mode}: makespan {summary['makespan_s']:.2f} s", flush=True)
    results: dict[str, dict] = {}
    records: dict[str, list[RequestRecord]] = {}
    for mode, done in runs.items():
        median = sorted(done, key=lambda x: x[0]["makespan_s"])[(len(done) - 1) // 2]
        results[mode], records[mode] = median
    check_same_work({m if repeats == 1 else f"{m}-r{s['repeat']}": s for m, done in runs.items() for s, _ in done})
    info = dict(meta or {}, pressure=pressure, seed=seed, trace=expected, priority=priority)
    spread = None
    if repeats > 1:
        spread = repeat_spread({m: [s for s, _ in done] for m, done in runs.items()})
        info["repeats"] = {"servers_per_mode": repeats, "by_mode": spread,
                           "order": [labels if r % 2 == 0 else labels[::-1] for r in range(repeats)]}
    path = write_results(out_dir, results, info, records if repeats == 1 else
                         {f"{m}-r{s['repeat']}": recs for m, done in runs.items() for s, recs in done})
    plots = write_plots(out_dir, results, records) if plots else []
    print(format_table(results))
    for mode, summary in results.items():
        if summary["engines"] > 1:      # a fleet behind a router: its engines one by one
            print(f"[bench] mode {mode}, per engine:\n{format_groups(summary)}")
    if spread is not None:
        print(format_repeats(spread))
    print(f"[bench] wrote {', '.join([path, *(os.path.basename(p) for p in plots)])}")
    return results

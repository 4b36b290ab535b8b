"""Closed-loop replay against a small real aiohttp server on 127.0.0.1 (a test double of the
SGLang-style /generate stream, /get_model_info and /metrics; the client under test is real)."""
import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from pdrollout.engine.workload.bench import replay, run_bench
from pdrollout.engine.workload.measures import BenchError

VOCAB = 97


class FakeServer:
    """Streams deterministic tokens, logs what arrived when; runs its own loop in a thread."""

    def __init__(self, cumulative=True, short_by=0):
        self.cumulative, self.short_by = cumulative, short_by
        self.log = {}  # rid -> dict(arrive, done, input_ids, output_ids, rollout_id)
        self.finished_rollouts = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def generate(self, req):
        body = await req.json()
        arrive = time.perf_counter()
        ids, sp = body["input_ids"], body["sampling_params"]
        assert sp["ignore_eos"] is True and sp["temperature"] == 0 and body["stream"] is True
        n = sp["max_new_tokens"] - self.short_by
        cached = max((len(e["input_ids"]) + len(e["output_ids"]) for e in self.log.values()
                      if ids[:len(e["input_ids"])] == e["input_ids"]), default=0)
        out = [(sum(ids) + 7 * i) % VOCAB for i in range(n)]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for i in range(n):
            await asyncio.sleep(0.002)
            chunk = out[: i + 1] if self.cumulative else out[i: i + 1]
            meta = {"id": body["rid"], "prompt_tokens": len(ids), "completion_tokens": i + 1,
                    "cached_tokens": cached,
                    "finish_reason": {"type": "length"} if i == n - 1 else None}
            await resp.write(b"data: " + json.dumps({"output_ids": chunk, "meta_info": meta}).encode()
                             + b"\n\n")
        self.log[body["rid"]] = dict(arrive=arrive, done=time.perf_counter(), input_ids=ids,
                                     output_ids=out, rollout_id=body.get("rollout_id"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def model_info(self, req):
        return web.json_response({"model_path": "fake", "vocab_size": VOCAB})

    async def metrics(self, req):
        n = len(self.log)
        return web.Response(text=(
            "# TYPE pdrollout:stalls_total counter\n"
            f"pdrollout:stalls_total {2 * n}\n"
            "# TYPE pdrollout:decode_wait_seconds histogram\n"
            f"pdrollout:decode_wait_seconds_sum {0.01 * n}\n"
            f"pdrollout:decode_wait_seconds_count {n}\n"), content_type="text/plain")

    async def finish(self, req):
        self.finished_rollouts.append((await req.json())["rollout_id"])
        return web.json_response({"ok": True})

    async def _start(self):
        app = web.Application()
        app.add_routes([web.post("/generate", self.generate), web.get("/metrics", self.metrics),
                        web.get("/get_model_info", self.model_info),
                        web.post("/rollout/finish", self.finish)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def __enter__(self):
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def rows_of(sessions):
    """sessions: {sid: [(input_length, output_length, delay_ms), ...]}"""
    return [{"session_id": sid, "turn": t, "input_length": i, "output_length": o, "delay_ms": d}
            for sid, turns in sessions.items() for t, (i, o, d) in enumerate(turns)]


def turn_of(rid):
    """rid = <rollout id>-<session id>-<turn> -> (session id, turn)"""
    _, sid, turn = rid.rsplit("-", 2)
    return sid, int(turn)


TRACE = rows_of({"s0": [(12, 4, 0), (3, 6, 1000), (5, 2, 2000)],
                 "s1": [(30, 8, 0), (4, 3, 1500)],
                 "s2": [(7, 1, 0), (2, 5, 500), (9, 3, 1000), (1, 1, 800)]})


@pytest.mark.parametrize("cumulative", [True, False])
def test_turns_wait_for_completion_plus_scaled_delay(cumulative):
    with FakeServer(cumulative=cumulative) as srv:
        summary, records = replay(srv.url, TRACE, pressure="P4", seed=3, progress=False)
    by_turn = {turn_of(rid): e for rid, e in srv.log.items()}
    assert len(srv.log) == len(TRACE) == summary["completed"]
    for row in TRACE:
        cur = by_turn[(row["session_id"], row["turn"])]
        assert len(cur["input_ids"]) >= row["input_length"]
        assert len(cur["output_ids"]) == row["output_length"]
        if row["turn"] == 0:
            assert len(cur["input_ids"]) == row["input_length"]
            continue
        prev = by_turn[(row["session_id"], row["turn"] - 1)]
        gap = cur["arrive"] - prev["done"]
        # Released only after the previous turn completed plus its wait x 0.10 (P4) ...
        assert gap >= row["delay_ms"] * 0.10 / 1000
        assert gap < row["delay_ms"] / 1000  # ... and the wait really was scaled
        # Whole context so far, then the new tokens.
        history = prev["input_ids"] + prev["output_ids"]
        assert cur["input_ids"][: len(history)] == history
        assert len(cur["input_ids"]) == len(history) + row["input_length"]
    # Sessions run side by side: requests of different sessions were in flight together.
    spans = [(turn_of(rid)[0], e["arrive"], e["done"]) for rid, e in srv.log.items()]
    assert any(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a in spans for b in spans)
    assert len({e["rollout_id"] for e in srv.log.values()}) == 1
    assert srv.finished_rollouts == [next(iter(srv.log.values()))["rollout_id"]]
    assert summary["total_output_tokens"] == sum(r["output_length"] for r in TRACE)
    assert summary["total_input_tokens"] == sum(len(e["input_ids"]) for e in srv.log.values())
    assert summary["stalls"] == 2 * len(TRACE)
    assert summary["mean_decode_wait_ms"] == pytest.approx(10.0)
    assert all(r.release_s <= r.first_token_s <= r.done_s for r in records)
    assert summary["total_cached_tokens"] > 0


def test_token_ids_are_deterministic_by_seed():
    with FakeServer() as a:
        replay(a.url, TRACE, pressure="P1", seed=11, progress=False)
    with FakeServer() as b:
        replay(b.url, TRACE, pressure="P1", seed=11, progress=False)
    with FakeServer() as c:
        replay(c.url, TRACE, pressure="P1", seed=12, progress=False)
    key = lambda srv: sorted((turn_of(rid), e["input_ids"]) for rid, e in srv.log.items())
    assert key(a) == key(b) != key(c)
    assert all(0 <= t < VOCAB for e in a.log.values() for t in e["input_ids"])


def test_short_output_is_a_clear_error():
    with FakeServer(short_by=1) as srv:
        with pytest.raises(BenchError, match=r"asked for exactly 4 tokens \(ignore_eos\), got 3"):
            replay(srv.url, TRACE[:1], pressure="P1", progress=False)


def test_a_request_that_fails_before_its_dead_server_is_reaped_names_the_death():
    """A killed server's sockets close before it can be reaped: the request fails first and the
    server reads as exited a little later (here on the watch's third look). The error is the death,
    with its log, not the broken connection; a server that stays alive leaves the HTTP error."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"   # nothing listens: every request fails
    looks = []
    dies_late = lambda: (looks.append(1), "the server exited with -9 during the replay" if len(looks) >= 3 else None)[1]
    with pytest.raises(BenchError, match="the server exited with -9 during the replay"):
        replay(url, TRACE[:1], pressure="P1", progress=False, watch=dies_late)
    with pytest.raises(BenchError, match=r"HTTP to http://127\.0\.0\.1:\d+ failed"):
        replay(url, TRACE[:1], pressure="P1", progress=False, watch=lambda: None)


def test_run_bench_against_url_writes_results_and_plots(tmp_path):
    with FakeServer() as srv:
        results = run_bench(TRACE, str(tmp_path), modes=["pd"], url=srv.url, pressure="P2",
                            progress=False)
    assert list(results) == ["pd"]
    data = json.loads((tmp_path / "results.json").read_text())
    pd = data["modes"]["pd"]
    for key in ("duration", "completed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
                "makespan_s", "p99_trajectory_s", "mean_decode_wait_ms", "rendezvous_count",
                "mean_rendezvous_ms", "stalls"):
        assert key in pd, key
    assert pd["completed"] == len(TRACE) and data["meta"]["pressure"] == "P2"
    assert (pd["speculative"], pd["speculative_k"]) == ("off", 0)   # the results say speculation was off
    for name in ("makespan.png", "ttft_cdf.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((tmp_path / "records-pd.jsonl").read_text().splitlines()) == len(TRACE)



def test_a_signal_dropped_in_a_finalizer_still_ends_the_replay():
    """The CI failure this guards: SIGTERM's KeyboardInterrupt raised inside aiohttp's
    ClientResponse.__del__ is printed and dropped by Python, and the bench ran to the end. The
    handler also records the signal; the replay's watcher raises it again within a tick."""
    from pdrollout.engine.workload import bench

    slow = rows_of({"s0": [(4, 2, 0), (3, 2, 60_000)]})   # a minute's wait between the turns
    with FakeServer() as srv:
        try:
            bench.interrupt(15)
        except KeyboardInterrupt:
            pass   # what Python does with an exception a __del__ raises: print it, go on
        t0 = time.monotonic()
        try:
            with pytest.raises(bench.Interrupted) as e:
                replay(srv.url, slow, pressure="trace", progress=False)
        finally:
            bench.pending_signal.clear()
    assert e.value.args == (15,) and time.monotonic() - t0 < 2 * bench.WATCH_S + 1.0

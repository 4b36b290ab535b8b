"""Issue 62: an error in one request's output processing fails that request alone. The engine thread
and its bridge as the server runs them (a real Engine on the tiny model, the asyncio side on this
test's loop); one request's stop-string decoder breaks at its third output: it ends with a 500 that
says why and the engine aborts it, the requests dispatched in the same batches return exactly their
tokens of a clean run, and the engine keeps serving."""
from __future__ import annotations

import asyncio

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.runtime.engine import Engine
from pdrollout.engine.scheduler.request import SamplingParams
from pdrollout.engine.server.bridge import EngineBridge, Tracked
from pdrollout.engine.server.metrics import ServerMetrics
from pdrollout.engine.server.stops import StopStrings

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5], [3, 5, 8, 9, 7, 9], [2, 7, 1, 8]]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


class BrokenDecoder:
    """A decoder that works twice, then raises (a tokenizer bug met by one request's content)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ids):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("decoder broke")
        return "".join(chr(97 + i % 26) for i in ids)


async def run(bridge: EngineBridge, tag: str, broken: int | None = None) -> list[Tracked]:
    queue: asyncio.Queue = asyncio.Queue()
    tracked = [Tracked(rid=f"{tag}-{i}", arrival=0.0, wake=queue) for i in range(len(PROMPTS))]
    if broken is not None:
        tracked[broken].stops = StopStrings(("never-matches",), BrokenDecoder())
    for t in tracked:
        bridge.track(t)
    await bridge.call(lambda e: [e.submit(t.rid, p, SamplingParams.from_dict(GREEDY))
                                 for t, p in zip(tracked, PROMPTS)])
    while not all(t.finished for t in tracked):
        await asyncio.wait_for(queue.get(), 120)
    for t in tracked:
        bridge.untrack(t.rid)
    return tracked


async def test_a_request_whose_output_processing_fails_fails_alone(tiny_model):
    loop = asyncio.get_running_loop()
    config = EngineConfig(model=str(tiny_model), block_size=4, num_blocks=256)
    bridge = EngineBridge(lambda: Engine(config), loop, ServerMetrics())
    bridge.start()
    await asyncio.wait_for(bridge.ready.wait(), 120)
    try:
        clean = await run(bridge, "clean")
        assert all(len(t.output_ids) == 16 for t in clean)
        hit = await run(bridge, "hit", broken=1)
        bad = hit[1]
        assert bad.failure == ("output processing failed: RuntimeError: decoder broke", 500), bad.finish_reason
        assert 0 < len(bad.output_ids) < 16
        for t, ref in zip(hit, clean):
            if t is not bad:
                assert t.output_ids == ref.output_ids and t.finish_reason["type"] == "length", t
        # the engine aborted it (its KV freed) and serves on
        for _ in range(100):
            if not await bridge.call(lambda e: e.has_unfinished()):
                break
            await asyncio.sleep(0.05)
        assert not await bridge.call(lambda e: e.has_unfinished())
        again = await run(bridge, "again")
        assert [t.output_ids for t in again] == [t.output_ids for t in clean] and bridge.state == "ready"
    finally:
        await bridge.stop()

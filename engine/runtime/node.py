"""One node of a group: join the group's store, start this node's ranks, watch them.

Launch sequence (docs/DISTRIBUTED.md, "One engine across nodes"):
  1. node 0 hosts the TCPStore on the master port; every rank of every node connects to it
     (bounded: a store that never appears is a GroupJoinTimeout);
  2. every rank takes its slot `join/<rank>` (once per store: a store whose slot is taken serves
     another start of the group, so the rank connects again) and waits until all `world` ranks did,
     naming the missing ranks and their nodes if the join bound passes;
  3. the gloo default group forms over the store, the workers load their shards and create
     their data groups, and rank 0 runs the first step (a warm-up through every collective);
  4. node 0's HTTP API turns ready; every other node's /health turns ready once each of its
     ranks has executed that first step.
Any rank's stall or death ends every rank on every node (watchdog.py), and each process exits
with the code of exits.py; a node's launcher exits with the most telling code of its ranks.
"""
from __future__ import annotations

import datetime
import os
import secrets
import signal
import socket
import struct
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..protocol import metrics as metric
from ..protocol.exits import (EXIT_OK, GroupJoinTimeout, PeerLostError, is_connection_lost, most_telling,
                              name as exit_name, say)
from ..protocol.layout import GroupLayout
from .local_ranks import spawn

JOIN_POLL_S = 0.1
RECONNECT_S = 0.5    # between tries at a store that serves another start of the group


def gloo_ifname(host: str) -> str | None:
    """The interface that holds `host`, so gloo binds the pod's own address (it otherwise uses
    the hostname's, which need not be the pod IP). Loopback addresses live on `lo`."""
    if host.startswith("127.") or host == "localhost":
        return "lo"
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, ifname in socket.if_nameindex():
                try:
                    req = struct.pack("256s", ifname.encode()[:15])
                    addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])   # SIOCGIFADDR
                except OSError:
                    continue
                if addr == host:
                    return ifname
    except (ImportError, OSError):
        pass
    return None


def bind_gloo(host: str | None) -> None:
    """Point gloo at the interface holding `host` unless the environment already chose one."""
    if host and host not in ("0.0.0.0", "::") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        ifname = gloo_ifname(host)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname


def connect_store(layout: GroupLayout, rank: int, *, master: bool = False, timeout_s: float | None = None):
    """The group's TCPStore: hosted here on node 0 (`master`), else reached at the master address
    within the join bound (or `timeout_s`). torch's TCPStore listens on every address of node 0's port."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=layout.join_timeout_s if timeout_s is None else timeout_s)
    if master:
        return dist.TCPStore(layout.master_addr, layout.master_port, layout.world, True,
                             wait_for_workers=False, timeout=timeout)
    try:
        return dist.TCPStore(layout.master_addr, layout.master_port, layout.world, False, timeout=timeout)
    except Exception as e:   # DistStoreError/RuntimeError: node 0 never answered
        raise GroupJoinTimeout(f"rank {rank}: node 0's store at {layout.master_addr}:{layout.master_port} was not "
                               f"reachable within {layout.join_timeout_s:.0f}s ({type(e).__name__}: {e})") from None


class SlotTaken(PeerLostError):
    """The store already has this rank: it serves another start of the group (under the stable master
    name, a node 0 that is still stopping), not the one this rank belongs to."""

    def __init__(self, rank: int, holder: str) -> None:
        super().__init__(f"rank {rank}'s slot in node 0's store is held by {holder}")
        self.holder = holder


def claim(store, rank: int) -> None:
    """Take `rank`'s slot, atomically and once per store; SlotTaken when another process has it. The
    nonce tells two starts apart that share a host name and pid (a pod recreated under its name)."""
    me = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    holder = store.compare_set(f"join/{rank}", "", me).decode()
    if holder != me:
        raise SlotTaken(rank, holder)


def join(store, layout: GroupLayout, rank: int, ended=None) -> float:
    """Take `rank`'s slot and wait for the whole group; returns the seconds waited."""
    claim(store, rank)
    return wait_for_group(store, layout, rank, ended)


def wait_for_group(store, layout: GroupLayout, rank: int, ended=None) -> float:
    """`ended`: LocalRanks.first_exit of the ranks this process started; one that ends before the
    group forms fails the join at once (it would only time out)."""
    t0 = time.monotonic()
    keys = [f"join/{r}" for r in range(layout.world)]
    while True:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return time.monotonic() - t0
        gone = ended() if ended is not None else None
        if gone is not None:
            raise PeerLostError(f"rank {rank}: rank {gone[0]}, started here, exited ({exit_name(gone[1])}) "
                                f"before the group formed; {layout.world - len(missing)}/{layout.world} "
                                "joined (its log says why)")
        if time.monotonic() - t0 > layout.join_timeout_s:
            nodes = sorted({layout.node_of(r) for r in missing})
            raise GroupJoinTimeout(
                f"rank {rank}: ranks {missing} (node{'s' if len(nodes) > 1 else ''} "
                f"{', '.join(map(str, nodes))}) did not join within {layout.join_timeout_s:.0f}s; "
                f"{layout.world - len(missing)}/{layout.world} joined")
        time.sleep(JOIN_POLL_S)


def connect_and_join(layout: GroupLayout, rank: int, log=None):
    """A rank other than rank 0: reach node 0's store and join the group there; returns the store.
    A store that already has this rank belongs to another start of the group (node 0's stable name
    leads to the previous node 0 until it is gone): joining it would form a group with ranks on their
    way out. So the rank connects again, also when such a store goes away before the slot is taken,
    until it holds its slot in a store (the next node 0's), within the join bound."""
    log = log or log_stderr
    deadline = time.monotonic() + layout.join_timeout_s
    where = f"node 0's store at {layout.master_addr}:{layout.master_port}"
    said = None
    while True:
        store = connect_store(layout, rank, timeout_s=max(1.0, deadline - time.monotonic()))
        try:
            claim(store, rank)
        except SlotTaken as e:
            why = f"already has rank {rank} ({e.holder}): another start of the group"
        except Exception as e:
            if not is_connection_lost(e):
                raise
            why = f"went away before rank {rank} joined ({type(e).__name__})"
        else:
            wait_for_group(store, layout, rank)
            return store
        del store      # the connection goes with it
        if why != said:
            log(f"[rank {rank}] {where} {why}; connecting again")
            said = why
        if time.monotonic() + RECONNECT_S > deadline:
            raise GroupJoinTimeout(f"rank {rank}: {where} {why}, still after {layout.join_timeout_s:.0f}s")
        time.sleep(RECONNECT_S)


# ---- per-rank counters, shared with the node's launcher ---------------------------------
COUNTER_FIELDS = ("steps", "rounds", "rendezvous", "rendezvous_s", "decode_rows", "prefill_tokens")


class RankCounters:
    """Per-rank step counters in shared memory: each rank writes its own slot after every step,
    the node's HTTP side reads them for /health (ready once every rank ran a step) and /metrics."""

    def __init__(self, ranks: range, array=None) -> None:
        self.ranks = ranks
        if array is None:
            import multiprocessing
            array = multiprocessing.get_context("forkserver").Array("d", len(ranks) * len(COUNTER_FIELDS), lock=False)
        self.array = array

    def _base(self, rank: int) -> int:
        return (rank - self.ranks.start) * len(COUNTER_FIELDS)

    def add(self, rank: int, **deltas: float) -> None:
        b = self._base(rank)
        for k, v in deltas.items():
            self.array[b + COUNTER_FIELDS.index(k)] += v

    def get(self, rank: int) -> dict[str, float]:
        b = self._base(rank)
        return {k: self.array[b + i] for i, k in enumerate(COUNTER_FIELDS)}

    def all_stepped(self) -> bool:
        return all(self.get(r)["steps"] >= 1 for r in self.ranks)

    def __reduce__(self):   # the shared array travels to spawned ranks
        return (RankCounters, (self.ranks, self.array))


# ---- a worker node (node rank > 0) -------------------------------------------------------
class WorkerNode:
    """Node k > 0: runs its ranks (no planner, no API) and serves /health and /metrics for them
    on the engine port. Exits when its ranks exit, with their most telling code."""

    def __init__(self, layout: GroupLayout, target, args: tuple, host: str | None, port: int | None,
                 exit_wait_s: float = 60.0, log=print, metrics_port: int | None = None) -> None:
        self.layout, self.host, self.port, self.log = layout, host, port, log
        self.metrics_port = metrics_port   # /metrics alone on a second port (a policy admits scrapers there)
        self.exit_wait_s = exit_wait_s   # how long the other ranks may take to reach the group's verdict
        self.counters = RankCounters(layout.local_ranks)
        self.stopping = False
        # before the ranks exist: a SIGTERM between their spawn and run() would otherwise end this
        # launcher by the default action and leave them to join the next group (docs/OPERATOR.md)
        self._stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: (setattr(self, "stopping", True), self._stop.set()))
        self.local = spawn(layout, layout.local_ranks, target, (*args, self.counters))

    def health(self) -> tuple[int, dict]:
        codes = self.local.codes()
        alive = sum(c is None for c in codes.values())
        stepped = sum(self.counters.get(r)["steps"] >= 1 for r in self.layout.local_ranks)
        body = {"node_rank": self.layout.node_rank, "ranks": list(self.layout.local_ranks),
                "alive": alive, "stepped": stepped}
        if alive < len(codes):
            return 503, {**body, "status": "failed",
                         "exit_codes": {str(r): c for r, c in codes.items() if c is not None}}
        if stepped < len(codes):
            return 503, {**body, "status": "joining"}
        return 200, {**body, "status": "ok"}

    def metrics(self) -> bytes:
        return rank_metrics_text(self.counters, self.local.codes(), self.layout)

    def run(self) -> int:
        """Serve until the ranks end (or SIGTERM); returns the node's exit code."""
        stop = self._stop
        servers = [self._serve(port, only) for port, only in ((self.port, False), (self.metrics_port, True))
                   if port is not None]
        self.log(f"pdrollout node {self.layout.node_rank}: started ranks {list(self.layout.local_ranks)} "
                 f"({self.layout.describe()})")
        while not stop.wait(0.2) and self.local.first_exit() is None:
            pass
        if self.stopping:
            self.local.terminate()
            code = EXIT_OK
        else:
            # the first rank is gone; its peers end within the watchdog bound. Wait for them, so
            # the code reflects the group's verdict (a stall wins over the lost peers it causes).
            self.local.wait_all(self.exit_wait_s)
            self.local.terminate()
            code = most_telling(list(self.local.codes().values()))
        codes = self.local.codes()
        self.log(f"pdrollout node {self.layout.node_rank}: ranks ended "
                 + ", ".join(f"{r}: {c} ({exit_name(c)})" for r, c in codes.items())
                 + f"; exit {code} ({exit_name(code)})")
        for server in servers:
            server.shutdown()
        return code

    def _serve(self, port: int, metrics_only: bool):
        """A small threaded HTTP server: /health, /live and /metrics (the API is node 0's), or
        /metrics alone."""
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import json
        node = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):   # noqa: N802 (http.server's name)
                if metrics_only and self.path != "/metrics":
                    self._send(404, b'{"error": {"message": "this port serves /metrics only", "code": 404}}',
                               "application/json")
                elif self.path == "/health":
                    status, body = node.health()
                    self._send(status, json.dumps(body).encode(), "application/json")
                elif self.path.split("?")[0] == "/live":   # this node's ranks run (a stall ends them)
                    status, body = node.health()
                    live = 503 if body["status"] == "failed" else 200
                    self._send(live, json.dumps(body).encode(), "application/json")
                elif self.path == "/metrics":
                    from prometheus_client.exposition import CONTENT_TYPE_LATEST
                    self._send(200, node.metrics(), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, json.dumps({"error": {
                        "message": f"node {node.layout.node_rank} runs worker ranks only; the API is on node 0",
                        "code": 404}}).encode(), "application/json")

            do_POST = do_PUT = do_GET

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        server = ThreadingHTTPServer((self.host or "127.0.0.1", port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="node-http", daemon=True).start()
        self.log(f"pdrollout node {self.layout.node_rank}: {'/metrics' if metrics_only else '/health and /metrics'} "
                 f"on http://{server.server_address[0]}:{server.server_address[1]}")
        return server


def log_stderr(msg: str) -> None:
    say(msg)   # a worker node's verdict lines: never raising with no one reading (exits.say)


# Per-rank figures of one node's ranks: every node's /metrics shows its own ranks (node 0 also
# serves the engine-wide metrics above). Fields of `node.RankCounters`.
_RANK_COUNTERS = (("steps", "rank_steps", "Steps this rank executed"),
                  ("rounds", "rank_turnstile_rounds", "Turnstile rounds with a rendezvous on this rank"),
                  ("rendezvous", "rank_rendezvous", "Rendezvous this rank took part in"),
                  ("rendezvous_s", "rank_rendezvous_seconds", "Seconds this rank spent in rendezvous"),
                  ("decode_rows", "rank_decode_rows", "Decode rows of this rank's replica it executed"),
                  ("prefill_tokens", "rank_prefill_tokens", "Prefill tokens of this rank's replica it executed"))


class RankCollector:
    def __init__(self, counters, codes, layout) -> None:
        self.counters, self.codes, self.layout = counters, codes, layout

    def collect(self):
        node = str(self.layout.node_rank)
        codes = self.codes()
        up = GaugeMetricFamily(metric.PREFIX + "rank_up", "1 while the rank's process runs", labels=["rank", "node"])
        ready = GaugeMetricFamily(metric.PREFIX + "node_ranks_stepped", "Ranks of this node that executed a step",
                                  labels=["node"])
        families = {f: CounterMetricFamily(metric.PREFIX + n, h, labels=["rank", "node"]) for f, n, h in _RANK_COUNTERS}
        stepped = 0
        for r in self.layout.local_ranks:
            values = self.counters.get(r)
            up.add_metric([str(r), node], 1.0 if codes.get(r) is None else 0.0)
            stepped += values["steps"] >= 1
            for f, fam in families.items():
                fam.add_metric([str(r), node], values[f])
        ready.add_metric([node], stepped)
        yield up
        yield ready
        yield from families.values()


def rank_metrics_text(counters, codes: dict, layout) -> bytes:
    """/metrics of a worker node: its ranks only."""
    registry = CollectorRegistry()
    registry.register(RankCollector(counters, lambda: codes, layout))
    return generate_latest(registry)

"""KV accounting shared by prefill and decode (no tensors): a block pool with prefix reuse, and
KV reservations with lifetime ids. The storage is model/kv_cache.py.

Prefix reuse: a full block is identified by a hash chain over its tokens and its predecessor's, so
the next turn of a trajectory (whose input extends the previous turn's tokens) finds its KV.
Only blocks nobody references are evictable, so eviction never touches a running request.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class _Meta:
    hash: int
    parent: int
    tokens: tuple


class BlockPool:
    ROOT = 0x5EED

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()   # ref 0 but still cached (LRU order)
        self.meta: dict[int, _Meta] = {}
        self.by_hash: dict[int, int] = {}

    # --- capacity -------------------------------------------------------------------------
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def num_used(self) -> int:
        return self.num_blocks - self.num_available()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} released more often than it was taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.meta:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    # --- prefix reuse ---------------------------------------------------------------------
    def _chain(self, tokens: list[int], upto_blocks: int):
        parent = self.ROOT
        bs = self.block_size
        for i in range(upto_blocks):
            toks = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, toks))
            yield h, parent, toks
            parent = h

    def match_prefix(self, tokens: list[int], max_tokens: int, chain: list[int] | None = None) -> list[int]:
        """Takes a reference on the longest run of cached full blocks covering at most max_tokens.
        `chain` (if given) receives the hit blocks' hashes, so `commit` can continue from there."""
        hit, hashes = [], []
        for h, parent, toks in self._chain(tokens, max_tokens // self.block_size):
            b = self.by_hash.get(h)
            if b is None:
                break
            m = self.meta[b]
            if m.parent != parent or m.tokens != toks:
                break
            hit.append(b)
            hashes.append(h)
        for b in hit:
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1
        if chain is not None:
            chain[:] = hashes
        return hit

    def peek_prefix(self, tokens: list[int], max_tokens: int) -> tuple[int, int]:
        """Read-only: (reusable full blocks, how many of them are referenced by someone already)."""
        hits = shared = 0
        for h, parent, toks in self._chain(tokens, max_tokens // self.block_size):
            b = self.by_hash.get(h)
            if b is None or self.meta[b].parent != parent or self.meta[b].tokens != toks:
                break
            hits += 1
            shared += self.ref[b] > 0
        return hits, shared

    def commit(self, blocks: list[int], tokens: list[int], num_tokens: int, chain: list[int] | None = None) -> None:
        """Registers every full block among the first num_tokens tokens (idempotent). With `chain`
        (the hashes committed so far for these blocks) only the new full blocks are hashed."""
        chain = [] if chain is None else chain
        bs = self.block_size
        for i in range(len(chain), num_tokens // bs):
            parent = chain[-1] if chain else self.ROOT
            toks = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash((parent, toks))
            chain.append(h)
            b = blocks[i]
            if b in self.meta or h in self.by_hash:   # already registered, or same content elsewhere
                continue
            self.meta[b] = _Meta(h, parent, toks)
            self.by_hash[h] = b

    def _forget(self, b: int) -> None:
        m = self.meta.pop(b, None)
        if m is not None and self.by_hash.get(m.hash) == b:
            del self.by_hash[m.hash]

    def flush(self) -> int:
        """Drops every unreferenced cached block; returns how many."""
        n = len(self.evictable)
        while self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
            self.free.append(b)
        return n


class BlockTable(list):
    """A reservation's block ids. `frozen()` is one tuple until the table next changes: a step's rows
    carry it, and the step plan's encoder (runtime/plan_wire.py) sees an unchanged table by identity
    instead of comparing every block id of every row every step."""
    __slots__ = ("_frozen",)

    def frozen(self) -> tuple:
        t = getattr(self, "_frozen", None)
        if t is None:
            t = self._frozen = tuple(self)
        return t


def _changes(name: str):
    base = getattr(list, name)

    def change(self, *args, **kw):
        self._frozen = None
        return base(self, *args, **kw)
    change.__name__ = name
    return change


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop",
              "remove", "clear", "sort", "reverse"):
    setattr(BlockTable, _name, _changes(_name))


@dataclass
class Reservation:
    """KV held by one request lifetime. Blocks go back to the pool only when no submitted work for
    this lifetime is in flight, so a cancelled reservation is never reused under running work."""
    rid: str
    lifetime: int
    blocks: BlockTable = field(default_factory=BlockTable)
    chain: list[int] = field(default_factory=list)    # prefix hashes of the committed full blocks
    inflight: int = 0
    cancelled: bool = False
    released: bool = False


class Reservations:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self._next_lifetime = 1
        self.live: dict[str, Reservation] = {}
        self.draining: list[Reservation] = []

    def open(self, rid: str) -> Reservation:
        if rid in self.live:
            raise ValueError(f"request id {rid!r} already has a live reservation")
        r = Reservation(rid, self._next_lifetime)
        self._next_lifetime += 1
        self.live[rid] = r
        return r

    def is_current(self, rid: str, lifetime: int) -> bool:
        r = self.live.get(rid)
        return r is not None and r.lifetime == lifetime and not r.cancelled

    def begin_work(self, r: Reservation) -> None:
        r.inflight += 1

    def end_work(self, r: Reservation) -> None:
        r.inflight -= 1
        if r.cancelled and r.inflight == 0:
            self._release(r)

    def close(self, r: Reservation) -> None:
        """Cancel or finish: free now if nothing is in flight, else when the last work drains."""
        if self.live.get(r.rid) is r:
            del self.live[r.rid]
        r.cancelled = True
        if r.inflight == 0:
            self._release(r)
        else:
            self.draining.append(r)

    def _release(self, r: Reservation) -> None:
        if r.released:
            return
        r.released = True
        self.pool.release(r.blocks)
        r.blocks = BlockTable()
        if r in self.draining:
            self.draining.remove(r)

"""The model proposers of speculative decoding: a draft model (`--speculative draft --draft-model
DIR`) and the target's own MTP head (`--speculative mtp`, runtime/mtp.py).

Both run on rank 0, beside the planner: their drafts go into the rank-shared plan like the n-gram
proposer's, so every rank verifies the same rows and the proposer needs no collectives. They
propose greedily (a point-mass proposal: the target's acceptance rule in sampler.verify stays exact
for any temperature).

Their KV lives in a private paged cache. Per request a proposer keeps the sequence whose KV is
valid; a step feeds the entries after those (the accepted ones: one prefill-style row), then k - 1
single entries, each its own previous draft. Positions from the request's last real token on held
drafts only, so they are not kept: the next step rewrites them with what the target accepted (the
proposer's own rollback).

A finished request's valid entries are kept (`kept`, oldest first, dropped when the cache needs room):
an agent's next turn starts with its previous turn's tokens, so at admission its request adopts them
(`adopt`) instead of recomputing its whole context. The MTP head's entries also need the target's
hidden states, which a target prefix-cache hit skips computing: the scheduler caps the target's reuse
at the entries the head adopted, so under `mtp` the prefix cache serves an agent's turns as without it.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.kv_cache import KVCache
from ..model.loader import load_model, resolve_dtype
from ..protocol.config import EngineConfig, ModelConfig
from ..protocol.plan import Phase, RowSpec
from ..scheduler.kv_pool import BlockPool
from .batch import BatchBuilder


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slice compares run in C: bisect on them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n      # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PagedProposer:
    """A greedy proposer over a paged KV cache of its own; `_forward` runs the model on rows."""

    def __init__(self, cfg: ModelConfig, layers: int, dtype, device: torch.device, num_blocks: int,
                 block_size: int, block_tables: bool = False) -> None:
        self.cfg, self.device = cfg, device
        self.pool = BlockPool(num_blocks, block_size)
        self.kv = KVCache(layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.batches = BatchBuilder(block_size, device, block_tables=block_tables)
        self.blocks: dict[str, list[int]] = {}
        self.seen: dict[str, list[int]] = {}    # the sequence whose KV is valid, by rid
        self.tokens: dict[str, list[int]] = {}  # each rid's request tokens, the source of its entries
        # finished requests: id -> (tokens, seen, blocks, block chain), oldest first; found by the
        # hash chain of their tokens' full blocks, as the target's prefix cache finds blocks
        self.kept: OrderedDict[int, tuple[list[int], list[int], list[int], list[int]]] = OrderedDict()
        self._by_chain: dict[int, set[int]] = {}
        self._kept_ids = 0
        self._peeked: dict[str, tuple[int, int]] = {}   # rid -> (its tokens' length, peek) while kept is unchanged

    def _entries(self, tokens: int) -> int:
        """Entries of the proposer's sequence that depend only on a request's first `tokens` tokens."""
        return tokens

    def _chain(self, tokens: list[int]) -> list[int]:
        """A hash per full block of `tokens`, each covering every token before it."""
        bs, h, out = self.pool.block_size, 0, []
        for j in range(len(tokens) // bs):
            h = hash((h, tuple(tokens[j * bs:(j + 1) * bs])))
            out.append(h)
        return out

    def forget(self, alive: set[str]) -> None:
        """Finished requests' valid entries go to `kept` (their blocks with them)."""
        for rid in [r for r in self.blocks if r not in alive]:
            self._retire(rid)

    def _retire(self, rid: str) -> None:
        blocks, seen, tokens = self.blocks.pop(rid), self.seen.pop(rid), self.tokens.pop(rid, None)
        chain = self._chain(tokens) if seen and tokens is not None else []
        if not chain:
            self.pool.release(blocks)
            return
        self._kept_ids += 1
        self.kept[self._kept_ids] = (list(tokens), seen, blocks, chain)
        for h in chain:
            self._by_chain.setdefault(h, set()).add(self._kept_ids)
        self._peeked.clear()

    def _own(self, rid: str, tokens: list[int]) -> int | None:
        """A live rid's valid entries, if they are of these tokens (a finished rid may come back as
        a new request before `forget` runs: None)."""
        seen = self.seen.get(rid)
        if seen is None or self._sequence(tokens)[:len(seen)] != seen:
            return None
        return len(seen)

    def _drop(self, kid: int) -> tuple[list[int], list[int]]:
        """Takes a kept entry out; returns its (seen, blocks)."""
        _, seen, blocks, chain = self.kept.pop(kid)
        for h in chain:
            ids = self._by_chain[h]
            ids.discard(kid)
            if not ids:
                del self._by_chain[h]
        self._peeked.clear()
        return seen, blocks

    def drop_kept(self) -> None:
        """Every kept entry (new weights make them stale)."""
        for kid in list(self.kept):
            self.pool.release(self._drop(kid)[1])

    def clear(self) -> None:
        """Nothing held: no request's entries, none kept (the cache's memory is released)."""
        self.forget(set())
        self.drop_kept()

    def _best(self, tokens: list[int]) -> tuple[int | None, int]:
        """The kept entry with the most entries valid for `tokens`, and how many: the candidates
        share the deepest full block found; the exact common prefix decides."""
        best, most = None, 0
        for h in reversed(self._chain(tokens)):
            ids = self._by_chain.get(h)
            if not ids:
                continue
            for kid in ids:
                kt, seen, _, _ = self.kept[kid]
                n = min(len(seen), self._entries(common_prefix(kt, tokens)))
                if n > most:
                    best, most = kid, n
            break
        return best, most

    def peek(self, rid: str, tokens: list[int]) -> int:
        """What `adopt` would return; changes nothing (the planner asks every step)."""
        own = self._own(rid, tokens)
        if own is not None:
            return own
        memo = self._peeked.get(rid)
        if memo is None or memo[0] != len(tokens):
            memo = self._peeked[rid] = (len(tokens), self._best(tokens)[1])
        return memo[1]

    def adopt(self, rid: str, tokens: list[int]) -> int:
        """At admission: the request takes the kept entries valid for its tokens (its own, if it is
        being recomputed after a retraction). Returns its valid entries: positions from there on
        must be computed (by the target, for the MTP head's hidden states)."""
        own = self._own(rid, tokens)
        if own is not None:
            return own
        if rid in self.blocks:   # the rid's last request, finished: its entries may serve this one
            self._retire(rid)
        kid, n = self._best(tokens)
        if kid is None:
            return 0
        seen, blocks = self._drop(kid)
        self.blocks[rid], self.seen[rid], self.tokens[rid] = blocks, seen[:n], tokens
        return n

    def _room(self, rid: str, seq: list[int], upto: int) -> bool:
        """Blocks for positions < upto; a request whose sequence changed under its rid starts over."""
        seen, blocks = self.seen.setdefault(rid, []), self.blocks.setdefault(rid, [])
        if seq[:len(seen)] != seen:
            seen.clear()
        more = self.pool.blocks_for(upto) - len(blocks)
        if more > 0:
            got = self.pool.allocate(more)
            while got is None and self.kept:   # the oldest kept entries make room
                self.pool.release(self._drop(next(iter(self.kept)))[1])
                got = self.pool.allocate(more)
            if got is None:
                return False      # no room: this row gets no drafts this step
            blocks += got
        return True

    def _sequence(self, tokens: list[int]) -> list[int]:
        """The proposer's own sequence of a request's tokens (the draft model's: the tokens)."""
        return tokens

    def _ready(self, rid: str, seq: list[int], start: int) -> bool:
        """Can entries start.. of `seq` be computed now?"""
        return True

    @torch.inference_mode()
    def propose(self, wants: list[tuple[str, list[int], int]], alive: set[str]) -> dict[str, list[int]]:
        """`wants`: (rid, tokens, k) per decode row; returns up to k drafts per rid (greedy)."""
        self.forget(alive)
        seqs = []
        for rid, toks, k in wants:
            seq = self._sequence(toks) if k > 0 else None
            if seq and self._room(rid, seq, len(seq) + k - 1):
                self.tokens[rid] = toks
                seqs.append((rid, seq, k))
        # the entries the proposer has not seen (at least the last), one row each
        rows, live = [], []
        for rid, seq, k in seqs:
            start = min(len(self.seen[rid]), len(seq) - 1)
            if self._ready(rid, seq, start):
                live.append((rid, seq, k))
                rows.append(RowSpec(rid, Phase.PREFILL, start, tuple(seq[start:]), tuple(self.blocks[rid]), True))
        if not rows:
            return {}
        for rid, seq, _ in live:
            self.seen[rid] = list(seq)     # drafts' positions are never kept (rolled back by construction)
        # Each draft feeds the next on the device; one host copy at the end (a copy per draft step
        # would wait for the GPU k times an iteration, behind P's kernels under pd).
        steps = [(list(range(len(live))), self._forward(rows, Phase.PREFILL))]
        for step in range(1, max(k for _, _, k in live)):
            idx, prev = steps[-1]
            more = [j for j, i in enumerate(idx) if live[i][2] > step]
            ids = prev if len(more) == len(idx) else prev.index_select(0, _on(prev.device, more))
            rows = [RowSpec(live[idx[j]][0], Phase.DECODE, len(live[idx[j]][1]) + step - 1, (0,),
                            tuple(self.blocks[live[idx[j]][0]]), True) for j in more]
            # each step its own staging buffer: none is rewritten before the copy at the end
            steps.append(([idx[j] for j in more], self._forward(rows, Phase.DECODE, input_ids=ids, stage=step)))
        host = torch.cat([t for _, t in steps]).tolist()
        out = {rid: [] for rid, _, _ in live}
        for i, t in zip((i for idx, _ in steps for i in idx), host):
            out[live[i][0]].append(t)
        return out

    def _forward(self, rows: list[RowSpec], phase: Phase, input_ids: torch.Tensor | None = None,
                 stage: int = 0) -> torch.Tensor:
        """The model on `rows`: each row's greedy next token (device, int64, rows' order).
        `input_ids`: the decode rows' tokens on the device, in place of their RowSpec tokens."""
        raise NotImplementedError

    def _batch(self, rows: list[RowSpec], phase: Phase, input_ids, stage: int):
        batch = self.batches.build(rows, phase, stage=stage)
        if input_ids is not None:
            batch.input_ids = input_ids
        return batch


def _on(device: torch.device, values: list[int]) -> torch.Tensor:
    """Indices on `device` without a stream-ordered pageable copy (that would wait for the GPU)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class DraftProposer(PagedProposer):
    def __init__(self, config: EngineConfig, device: torch.device, num_blocks: int, model=None) -> None:
        """`model`: the draft, loaded once and shared by the replicas' proposers (None: load it)."""
        cfg = ModelConfig.load(config.draft_model)   # its vocabulary was checked with the config
        dtype = resolve_dtype("auto", cfg)           # what proposer_block_bytes sized the cache for
        self.model = model if model is not None else load_model(config.draft_model, device=device, dtype=dtype)
        super().__init__(cfg, cfg.num_hidden_layers, dtype, device, num_blocks, config.block_size)

    def _forward(self, rows: list[RowSpec], phase: Phase, input_ids=None, stage: int = 0) -> torch.Tensor:
        logits = self.model(self._batch(rows, phase, input_ids, stage), self.kv)
        return torch.argmax(logits, dim=-1)


class ProposerMemory:
    """What the model proposers hold on rank 0 beyond the target: their paged KV caches and the
    models only they use (the draft; the unsharded MTP head copy on several ranks). Released and
    resumed with the engine's memory tags, so an RL loop that gives the GPU back between rollouts
    gives all of it back."""

    def __init__(self, proposers: list[PagedProposer], models: list) -> None:
        self.proposers, self.models = proposers, models
        self.released: set[str] = set()
        self._backup: list[dict[str, torch.Tensor]] = []

    def release(self, tags: set[str]) -> None:
        tags = tags - self.released
        if "kv_cache" in tags:   # an idle engine: no request holds KV, so no proposer state is in use
            for p in self.proposers:
                p.clear()
                p.kv.release()
        if "weights" in tags:
            for m in self.models:   # host copies: outputs after resume equal those before
                params = dict(m.named_parameters())
                self._backup.append({n: t.data.to("cpu", copy=True) for n, t in params.items()})
                for t in params.values():
                    t.data = t.data.new_empty(0)
        self.released |= tags

    def drop_kept(self) -> None:
        for p in self.proposers:
            p.drop_kept()

    def resume(self, tags: set[str]) -> None:
        tags = tags & self.released
        if "kv_cache" in tags:
            for p in self.proposers:
                p.kv.resume()
        if "weights" in tags:
            for m, saved in zip(self.models, self._backup):
                for n, t in m.named_parameters():
                    t.data = saved[n].to(t.device)
                m.fuse_projections()
            self._backup = []
        self.released -= tags

    def bytes(self) -> dict[str, int]:
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        return {"weights": sum(size(p.data for p in m.parameters()) for m in self.models),
                "kv_cache": sum(p.kv.nbytes() for p in self.proposers)}

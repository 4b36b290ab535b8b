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
"""
from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.loader import load_model, resolve_dtype
from ..protocol.config import EngineConfig, ModelConfig
from ..protocol.plan import Phase, RowSpec
from ..scheduler.kv_pool import BlockPool
from .batch import BatchBuilder


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

    def forget(self, alive: set[str]) -> None:
        for rid in [r for r in self.blocks if r not in alive]:
            self.pool.release(self.blocks.pop(rid))
            del self.seen[rid]

    def _room(self, rid: str, seq: list[int], upto: int) -> bool:
        """Blocks for positions < upto; a request whose sequence changed under its rid starts over."""
        seen, blocks = self.seen.setdefault(rid, []), self.blocks.setdefault(rid, [])
        if seq[:len(seen)] != seen:
            seen.clear()
        more = self.pool.blocks_for(upto) - len(blocks)
        if more > 0:
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
        seqs = [(rid, self._sequence(toks), k) for rid, toks, k in wants if k > 0]
        seqs = [(rid, seq, k) for rid, seq, k in seqs if seq and self._room(rid, seq, len(seq) + k - 1)]
        # the entries the proposer has not seen (at least the last), one row each
        rows, live = [], []
        for rid, seq, k in seqs:
            start = min(len(self.seen[rid]), len(seq) - 1)
            if self._ready(rid, seq, start):
                live.append((rid, seq, k))
                rows.append(RowSpec(rid, Phase.PREFILL, start, tuple(seq[start:]), tuple(self.blocks[rid]), True))
        if not rows:
            return {}
        out = {rid: [] for rid, _, _ in live}
        for (rid, seq, k), t in zip(live, self._forward(rows, Phase.PREFILL)):
            out[rid].append(t)
            self.seen[rid] = list(seq)     # drafts' positions are never kept (rolled back by construction)
        for step in range(1, max(k for _, _, k in live)):
            more = [(rid, seq, k) for rid, seq, k in live if k > step]
            rows = [RowSpec(rid, Phase.DECODE, len(seq) + step - 1, (out[rid][-1],), tuple(self.blocks[rid]), True)
                    for rid, seq, _ in more]
            for (rid, _, _), t in zip(more, self._forward(rows, Phase.DECODE)):
                out[rid].append(t)
        return out

    def _forward(self, rows: list[RowSpec], phase: Phase) -> list[int]:
        raise NotImplementedError


class DraftProposer(PagedProposer):
    def __init__(self, config: EngineConfig, device: torch.device, num_blocks: int, model=None) -> None:
        """`model`: the draft, loaded once and shared by the replicas' proposers (None: load it)."""
        cfg = ModelConfig.load(config.draft_model)   # its vocabulary was checked with the config
        dtype = resolve_dtype("auto", cfg)           # what proposer_block_bytes sized the cache for
        self.model = model if model is not None else load_model(config.draft_model, device=device, dtype=dtype)
        super().__init__(cfg, cfg.num_hidden_layers, dtype, device, num_blocks, config.block_size)

    def _forward(self, rows: list[RowSpec], phase: Phase) -> list[int]:
        batch = self.batches.build(rows, phase)
        logits = self.model(batch, self.kv)
        return torch.argmax(logits, dim=-1).tolist()


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
                p.forget(set())
                p.kv.release()
        if "weights" in tags:
            for m in self.models:   # host copies: outputs after resume equal those before
                params = dict(m.named_parameters())
                self._backup.append({n: t.data.to("cpu", copy=True) for n, t in params.items()})
                for t in params.values():
                    t.data = t.data.new_empty(0)
        self.released |= tags

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

"""The draft-model proposer of speculative decoding (`--speculative draft --draft-model DIR`).

A smaller checkpoint with the target's vocabulary runs on rank 0, beside the planner: its drafts go
into the rank-shared plan like the n-gram proposer's, so every rank verifies the same rows and the
draft needs no collectives. It proposes greedily (a point-mass proposal: the target's acceptance
rule in sampler.verify stays exact for any temperature).

Its KV lives in a private paged cache. Per request it keeps the tokens whose draft KV is valid;
a step feeds the tokens after those (the accepted ones: one prefill-style row), then k - 1 single
tokens. Positions from the request's last real token on held drafts only, so they are not kept:
the next step rewrites them with what the target accepted (the draft's own rollback).
"""
from __future__ import annotations

import torch

from ..model.kv_cache import KVCache
from ..model.loader import load_model
from ..protocol.config import EngineConfig, ModelConfig
from ..protocol.plan import Phase, RowSpec
from ..scheduler.kv_pool import BlockPool
from .batch import BatchBuilder


class DraftProposer:
    def __init__(self, config: EngineConfig, device: torch.device, num_blocks: int) -> None:
        cfg = ModelConfig.load(config.draft_model)   # its vocabulary was checked with the config
        self.cfg, self.device = cfg, device
        self.model = load_model(config.draft_model, device=device)
        dtype = next(self.model.parameters()).dtype
        bs = config.block_size
        self.pool = BlockPool(num_blocks, bs)
        self.kv = KVCache(cfg.num_hidden_layers, num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.batches = BatchBuilder(bs, device, block_tables=False)
        self.blocks: dict[str, list[int]] = {}
        self.seen: dict[str, list[int]] = {}    # tokens whose draft KV is valid, by rid

    def forget(self, alive: set[str]) -> None:
        for rid in [r for r in self.blocks if r not in alive]:
            self.pool.release(self.blocks.pop(rid))
            del self.seen[rid]

    def _room(self, rid: str, tokens: list[int], upto: int) -> bool:
        """Blocks for positions < upto; a request whose tokens changed under its rid starts over."""
        seen, blocks = self.seen.setdefault(rid, []), self.blocks.setdefault(rid, [])
        if tokens[:len(seen)] != seen:
            seen.clear()
        more = self.pool.blocks_for(upto) - len(blocks)
        if more > 0:
            got = self.pool.allocate(more)
            if got is None:
                return False      # no room: this row gets no drafts this step
            blocks += got
        return True

    @torch.inference_mode()
    def propose(self, wants: list[tuple[str, list[int], int]], alive: set[str]) -> dict[str, list[int]]:
        """`wants`: (rid, tokens, k) per decode row; returns up to k drafts per rid (greedy)."""
        self.forget(alive)
        wants = [(rid, toks, k) for rid, toks, k in wants if k > 0 and self._room(rid, toks, len(toks) + k - 1)]
        if not wants:
            return {}
        # the tokens the draft has not seen (at least the row's last token), one row each
        rows = []
        for rid, toks, _ in wants:
            start = min(len(self.seen[rid]), len(toks) - 1)
            rows.append(RowSpec(rid, Phase.PREFILL, start, tuple(toks[start:]), tuple(self.blocks[rid]), True))
        out = {rid: [] for rid, _, _ in wants}
        nxt = self._forward(rows, Phase.PREFILL)
        for (rid, toks, k), t in zip(wants, nxt):
            out[rid].append(t)
            self.seen[rid] = list(toks)     # drafts' positions are never kept (rolled back by construction)
        for step in range(1, max(k for _, _, k in wants)):
            live = [(rid, toks, k) for rid, toks, k in wants if k > step]
            rows = [RowSpec(rid, Phase.DECODE, len(toks) + step - 1, (out[rid][-1],), tuple(self.blocks[rid]), True)
                    for rid, toks, _ in live]
            for (rid, _, _), t in zip(live, self._forward(rows, Phase.DECODE)):
                out[rid].append(t)
        return out

    def _forward(self, rows: list[RowSpec], phase: Phase) -> list[int]:
        batch = self.batches.build(rows, phase)
        logits = self.model(batch, self.kv)
        return torch.argmax(logits, dim=-1).tolist()

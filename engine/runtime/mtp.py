"""The MTP proposer of speculative decoding (`--speculative mtp`): the target checkpoint's own
multi-token-prediction head (model/qwen3_moe.py MTPHead, Qwen3-Next's `mtp.*` layout).

Entry i of the head's sequence pairs the target's final hidden state at position i with token
i + 1, at position i; it predicts token i + 2. So for a request of n tokens (the last one not yet
run by the target) entries 0..n-2 are computable from what the target ran, and entry n-2 predicts
the token after the decode row's token: draft 1. Drafts 2..k chain the head on itself: entry
n-2+j takes draft j and the head's own output hidden state in place of the target's. The paged KV,
its rollback and the per-request bookkeeping are the draft proposer's (draft.py): the head's
sequence is the request's tokens shifted by one.

The target's hidden states come from the worker (Worker.hidden, a HiddenStates) after every step:
prefill rows, plain decode rows and verify rows. A verify row's states past its accepted drafts
were computed from rejected tokens; the next step recomputes those positions and overwrites them.

On several ranks rank 0's worker holds a shard whose forward runs collectives, so the head runs on
an unsharded copy of its own (`head_model`: the `mtp.*` tensors, the embedding, the final norm and
lm_head, loaded on rank 0 only), and the other replicas' hidden states come in their leaders'
step reports (StepReport.hidden). One proposer per replica: a scheduler forgets what it does not hold.
"""
from __future__ import annotations

import threading

import torch

from ..model.checkpoint import random_model
from ..model.loader import load_model
from ..protocol.config import EngineConfig
from ..protocol.plan import Phase, RowSpec
from .batch import forward_order
from .draft import PagedProposer


class HiddenStates:
    """A worker's rows' final hidden states since the last take: rid -> [(start position, [len, H])]."""

    def __init__(self) -> None:
        self.parts: dict[str, list] = {}
        self.lock = threading.Lock()   # a P thread (solo_p.py, pd_step.py) adds beside the step loop

    def keep(self, batch, rows) -> None:
        """A forward's rows (a batch that kept no hidden states: nothing)."""
        if batch.hidden is not None:
            self.keep_rows(batch.hidden, rows)

    def keep_rows(self, hidden, rows) -> None:
        """`hidden`: [tokens, H], the rows' tokens in the batch builder's order (a graph's too)."""
        t0 = 0
        with self.lock:
            for r in forward_order(rows):
                if not r.routes:   # a routed request gets no drafts (scheduler): nothing would consume them
                    self.parts.setdefault(r.rid, []).append((r.start, hidden[t0:t0 + r.length]))
                t0 += r.length

    def take(self, host: bool = False) -> dict[str, list]:
        """`host`: as compact host copies, for a step report (a device view would pickle its whole batch)."""
        with self.lock:
            out, self.parts = self.parts, {}
        if host:
            out = {rid: [(start, h.to("cpu", copy=True)) for start, h in ps] for rid, ps in out.items()}
        return out


def head_model(config: EngineConfig, worker):
    """The model whose `mtp_forward` the proposer runs: on one rank the worker's own; on several an
    unsharded head on rank 0's device (random_weights: the same per-name seeds as one rank's)."""
    if not worker.multi:
        return worker.model
    kw = dict(device=worker.device, dtype=worker.dtype, backends=worker.backends, mtp=True, head_only=True)
    if config.random_weights:
        return random_model(worker.cfg, seed=config.seed, **kw)
    return load_model(config.model, **kw)


class MTPProposer(PagedProposer):
    def __init__(self, config: EngineConfig, worker, num_blocks: int, model=None) -> None:
        self.model = model if model is not None else worker.model
        if self.model.mtp is None:
            raise ValueError(f"{config.model}: no MTP head loaded (config.json num_nextn_predict_layers)")
        super().__init__(worker.cfg, len(self.model.mtp.layers), worker.dtype, worker.device, num_blocks,
                         config.block_size, worker.backends.attention.needs_block_tables)
        self.hidden: dict[str, tuple[int, torch.Tensor]] = {}   # rid -> (first position, states [n, H])
        self._last: dict[str, torch.Tensor] = {}               # rid -> the head's hidden of its last draft

    def add(self, parts: dict[str, list]) -> None:
        """The target's final hidden states of a step's rows: rid -> [(start position, [len, H])].
        A later write of a position replaces it and everything after it (those were computed
        from tokens that are now rewritten)."""
        for rid, chunks in parts.items():
            for start, h in chunks:
                h = h.to(self.device)   # another leader's come on the host
                base, old = self.hidden.get(rid, (start, h[:0]))
                if base <= start <= base + len(old):
                    self.hidden[rid] = (base, torch.cat([old[:start - base], h]))
                else:   # a gap (or a restart): only what came now is usable
                    self.hidden[rid] = (start, h)

    def forget(self, alive: set[str]) -> None:
        super().forget(alive)
        for held in (self.hidden, self._last):
            for rid in [r for r in held if r not in alive]:
                del held[rid]

    def _retire(self, rid: str) -> None:
        super()._retire(rid)
        self.hidden.pop(rid, None)   # a new request under the rid brings its own
        self._last.pop(rid, None)

    def _sequence(self, tokens: list[int]) -> list[int]:
        return tokens[1:]

    def _entries(self, tokens: int) -> int:
        return max(tokens - 1, 0)   # entry i pairs the target's state at i with token i + 1

    def _ready(self, rid: str, seq: list[int], start: int) -> bool:
        base, h = self.hidden.get(rid, (0, None))
        return h is not None and base <= start and base + len(h) >= len(seq)

    def _forward(self, rows: list[RowSpec], phase: Phase, input_ids=None, stage: int = 0) -> torch.Tensor:
        if phase is Phase.PREFILL:   # entries start..len-1: the target's states at those positions
            parts = []
            for r in rows:
                base, h = self.hidden[r.rid]
                end = r.start + r.length
                parts.append(h[r.start - base:end - base])
                # the last entry's state stays: a step whose row emitted nothing recomputes it
                self.hidden[r.rid] = (end - 1, h[end - 1 - base:])
            hidden = torch.cat(parts)
        else:
            hidden = torch.stack([self._last[r.rid] for r in rows])
        logits, out = self.model.mtp_forward(self._batch(rows, phase, input_ids, stage), self.kv, hidden)
        for r, h in zip(rows, out):
            self._last[r.rid] = h
        return torch.argmax(logits, dim=-1)

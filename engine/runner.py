"""The model runner: turns a plan into one flat forward batch, runs it, samples.

It holds no scheduling state: the engine tells it which rows to run and where their KV lives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import ForwardBatch, SeqSlice
from .planner import Plan
from .kv_cache import Reservation
from .request import Req
from .sampling import sample


@dataclass
class Row:
    """One row of a launched step, bound to the request lifetime it was launched for."""
    req: Req
    reservation: "Reservation"
    lifetime: int
    kind: str            # "decode" | "prefill"
    length: int          # tokens computed by this row
    samples: bool        # produces a token


@dataclass
class StepResult:
    rows: list[Row]
    tokens: dict[int, int]          # row index -> sampled token
    logprobs: dict[int, float]


class ModelRunner:
    def __init__(self, model, kv, block_size: int, device, *, max_batch: int = 64, max_context_len: int = 0,
                 null_slot: int = 0, cuda_graphs: bool = True):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.graphs = None
        if self.cuda:
            model.use_cuda_kernels()
            if cuda_graphs:
                from .cuda_graph import DecodeGraphs
                max_blocks = -(-max_context_len // block_size)
                self.graphs = DecodeGraphs(model, kv, block_size, max_batch, max_blocks, null_slot)
                self.graphs.capture()

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def build(self, plan: Plan, reqs: dict[str, Req]) -> tuple[ForwardBatch, list[Row]]:
        ids, positions, slot_map, seqs, logit_rows, rows = [], [], [], [], [], []
        t = 0

        def add(req: Req, start: int, n: int, kind: str, samples: bool):
            nonlocal t
            blocks = req.reservation.blocks
            ids.extend(req.tokens[start:start + n])
            positions.extend(range(start, start + n))
            ctx_slots = self._slots(blocks, 0, start + n)
            slot_map.append(ctx_slots[start:])
            seqs.append(SeqSlice(t, n, start + n, ctx_slots.to(self.device)))
            if samples:
                logit_rows.append(t + n - 1)
            rows.append(Row(req, req.reservation, req.lifetime, kind, n, samples))
            t += n

        for rid in plan.decode:
            r = reqs[rid]
            add(r, len(r.tokens) - 1, 1, "decode", True)
        for seg in plan.prefill:
            add(reqs[seg.rid], seg.start, seg.length, "prefill", seg.completes)
        phase = "mixed" if plan.decode and plan.prefill else ("decode" if plan.decode else "prefill")
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.cat(slot_map).to(dev),
            seqs=seqs,
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            phase=phase,
        )
        if self.cuda:
            nd = len(plan.decode)
            tables = [reqs[rid].reservation.blocks for rid in plan.decode]
            width = max((len(t) for t in tables), default=1)
            bt = torch.zeros(nd, width, dtype=torch.int32)
            for i, t in enumerate(tables):
                bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            batch.num_decode = nd
            batch.block_tables = bt.to(dev)
            batch.seq_lens = torch.tensor([s.ctx_len for s in seqs[:nd]], dtype=torch.int32, device=dev)
            batch.block_size = self.block_size
        return batch, rows

    def _run_graph(self, plan: Plan, reqs: dict[str, Req]):
        ids, positions, slots, tables, rows = [], [], [], [], []
        bs = self.block_size
        for rid in plan.decode:
            r = reqs[rid]
            p = len(r.tokens) - 1
            blocks = r.reservation.blocks
            ids.append(r.tokens[p])
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            tables.append(blocks)
            rows.append(Row(r, r.reservation, r.lifetime, "decode", 1, True))
        return self.graphs.run(ids, positions, slots, tables), rows

    def run(self, plan: Plan, reqs: dict[str, Req], gens: dict) -> StepResult:
        if self.graphs is not None and not plan.prefill and self.graphs.fits(len(plan.decode)):
            logits, rows = self._run_graph(plan, reqs)
        else:
            batch, rows = self.build(plan, reqs)
            logits = self.model(batch, self.kv)
        sampling_rows = [i for i, r in enumerate(rows) if r.samples]
        tokens, lps = {}, {}
        if sampling_rows:
            want = any(rows[i].req.return_logprob for i in sampling_rows)
            toks, lp = sample(logits, [rows[i].req.sampling for i in sampling_rows],
                              [gens[rows[i].req.rid] for i in sampling_rows], want)
            for j, i in enumerate(sampling_rows):
                tokens[i] = toks[j]
                if lp is not None:
                    logprobs_i = lp[j]
                    lps[i] = logprobs_i
        return StepResult(rows, tokens, lps)

"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Greedy rows (the RL-rollout common case at temperature 0, and every benchmark) are decided on the
device with one argmax; only rows that really sample move their logits to the host.
"""
from __future__ import annotations

import zlib

import torch

from ..scheduler.request import SamplingParams


def request_seed(engine_seed: int, rid: str) -> int:
    """A request's generator seed when its sampling params give none: one formula on every rank."""
    return engine_seed ^ zlib.crc32(rid.encode())


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(params.seed if params.seed is not None else fallback_seed)


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    row = row.float().cpu()
    scaled = row / p.temperature
    if not torch.isfinite(scaled).all():
        # A tiny temperature overflows fp32 (or rounds to 0 in it): scale the gaps to the max in
        # fp64 instead, where every positive temperature a JSON number can carry is nonzero.
        scaled = (row.double() - row.max()) / p.temperature
    row = scaled
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > p.top_p   # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
           want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """logits: fp32 [S, V]. Logprobs are of the unscaled distribution (as SGLang reports by default)."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, gens[i])
    lps = None
    if want_logprobs:
        lp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.tensor(out, device=logits.device)
        lps = lp[torch.arange(len(out), device=logits.device), idx].tolist()
    return out, lps

"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""
from __future__ import annotations

import torch

from .request import SamplingParams


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(params.seed if params.seed is not None else fallback_seed)


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
           want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """logits: fp32 [S, V]. Logprobs are of the unscaled distribution (as SGLang reports by default)."""
    logits = logits.float().cpu()
    greedy = torch.argmax(logits, dim=-1)
    out = greedy.tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > p.top_p          # keep the smallest prefix reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=gens[i]).item())
    lps = None
    if want_logprobs:
        lp = torch.log_softmax(logits, dim=-1)
        lps = lp[torch.arange(len(out)), torch.tensor(out)].tolist()
    return out, lps

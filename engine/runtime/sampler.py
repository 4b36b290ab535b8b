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


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row samples from: temperature, then top-k, then top-p."""
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
    return probs


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    return int(torch.multinomial(_probs(row, p), 1, generator=gen).item())


def verify(logits: torch.Tensor, drafts: list[int], p: SamplingParams, gen: torch.Generator) -> list[int]:
    """A verify row's emitted tokens: the accepted prefix of `drafts`, then one token of the target.
    logits: [len(drafts) + 1, V], position i scoring the token after draft i - 1.

    Greedy: a draft is accepted while it equals the target's argmax, and the target's argmax at the
    first mismatch (or after the last draft) follows: exactly the tokens greedy decoding emits.
    Sampling (speculative sampling with a point-mass proposal q = 1 at the draft x): accept x with
    probability min(1, p(x)/q(x)) = p(x); on rejection sample from norm(max(p - q, 0)), i.e. p with
    x removed; after k accepted drafts sample position k from p. Each emitted token is then
    distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023)."""
    if p.greedy:
        target = torch.argmax(logits, dim=-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            out.append(target[i])
            if d != target[i]:
                return out
        out.append(target[len(drafts)])
        return out
    out = []
    for i, d in enumerate(drafts):
        probs = _probs(logits[i], p)
        u = torch.rand((), generator=gen).item()
        if u < probs[d].item():
            out.append(d)
            continue
        rest = probs.clone()
        rest[d] = 0.0
        if rest.sum() <= 0:   # p was a point mass at x: u < 1 = p(x) always accepts; float guard
            out.append(d)
            continue
        out.append(int(torch.multinomial(rest, 1, generator=gen).item()))
        return out
    out.append(_sample_row(logits[len(drafts)], p, gen))
    return out


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

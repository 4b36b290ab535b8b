"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Everything runs on the logits' device, batched: greedy rows take one argmax; sampling rows (an RL
rollout's temperature 1) are scaled, masked and normalized together, and each draws its token by
the exponential race (argmax of p / q with q ~ Exp(1) drawn from the request's own generator, which
picks token i with probability p_i). So a request's tokens depend on its seed and logits only, not
on its batch, and no row's logits (a vocabulary each) cross to the host.
"""
from __future__ import annotations

import zlib

import torch

from ..scheduler.request import SamplingParams

_TINY = torch.finfo(torch.float32).tiny


def request_seed(engine_seed: int, rid: str) -> int:
    """A request's generator seed when its sampling params give none: one formula on every rank."""
    return engine_seed ^ zlib.crc32(rid.encode())


def make_generator(params: SamplingParams, fallback_seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """On the device whose logits it samples (its draws are made there)."""
    g = torch.Generator(device=device)
    return g.manual_seed(params.seed if params.seed is not None else fallback_seed)


def _probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions sampling rows draw from ([S, V] fp32): temperature, then top-k, then top-p."""
    x = logits.float()
    # Gaps to the row's max over the temperature: <= 0, and -inf (probability 0) where a tiny
    # temperature overflows fp32. Temperatures below fp32's range act as its smallest one: every
    # gap a logit can have then still overflows, so the row keeps its argmax (and its ties).
    t = torch.tensor([p.temperature for p in params], dtype=torch.float64).clamp_min(_TINY)
    x = (x - x.max(dim=-1, keepdim=True).values) / t.to(x.device, torch.float32).unsqueeze(1)
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        top = torch.topk(x, max(k for k in ks if k < vocab), dim=-1).values
        kth = top.gather(1, torch.tensor([min(k, top.shape[1]) - 1 for k in ks], device=x.device).unsqueeze(1))
        kth[torch.tensor(ks, device=x.device) == vocab] = float("-inf")   # rows without top-k keep all
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    if (top_p < 1.0).any():
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix reaching top_p
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > top_p.to(probs.device).unsqueeze(1)
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p.masked_fill(drop, 0.0))
    return probs


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's distribution ([V])."""
    return _probs_rows(row.unsqueeze(0), [p])[0]


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row ([S] on the logits' device), each from its request's generator."""
    probs = _probs_rows(logits, params)
    q = torch.empty_like(probs)
    for i, g in enumerate(gens):
        q[i].exponential_(generator=g)
    # The CPU's draw is -log1p(-u) with u in [0, 1): exactly 0 now and then, which would make a
    # masked token's 0 / 0 a NaN that argmax picks (CUDA's excludes 0 already).
    return torch.argmax(probs / q.clamp_min_(_TINY), dim=-1)


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Greedy verify on the target's argmax per position (len(drafts) + 1 of them): the drafts
    while they equal it, then the target's token at the first mismatch or after the last draft."""
    for i, d in enumerate(drafts):
        if d != target[i]:
            return target[:i + 1]
    return target[:len(drafts) + 1]


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
        return accept_greedy(torch.argmax(logits, dim=-1).tolist(), drafts)
    out = []
    for i, d in enumerate(drafts):
        probs = _probs(logits[i], p)
        u = torch.rand((), generator=gen, device=gen.device).item()
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
    out.append(int(_sample_rows(logits[len(drafts):len(drafts) + 1], [p], [gen])[0]))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
           want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """logits: fp32 [S, V]. Logprobs are of the unscaled distribution (as SGLang reports by default)."""
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = _sample_rows(logits[idx], [params[i] for i in rows], [gens[i] for i in rows])
    out = out.tolist()
    lps = None
    if want_logprobs:
        lp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.tensor(out, device=logits.device)
        lps = lp[torch.arange(len(out), device=logits.device), idx].tolist()
    return out, lps

"""Draft proposers of speculative decoding (planner side, no tensors).

The n-gram (prompt-lookup) proposer: the longest suffix of a request's tokens (up to `max_n`
tokens) that occurred earlier in them proposes the tokens that followed its latest earlier
occurrence. It runs on rank 0 in the planner, so the drafts travel in the rank-shared plan and
every rank verifies the same ones. Agentic rollouts repeat their context (tool output, code)
often, which is where this pays off.
"""
from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1, window: int = 8192) -> list[int]:
    """Up to k draft tokens continuing `tokens`; [] when no suffix recurs. The search looks back
    `window` tokens: a planner-side cost per decode row and step, bounded for long agentic contexts."""
    if k <= 0:
        return []
    size = len(tokens)
    lo = max(0, size - window)
    last = tokens[-1] if tokens else None
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # the latest earlier occurrence: recent context predicts best
        for start in range(size - n - 1, lo - 1, -1):
            if tokens[start + n - 1] == last and tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []

"""First uses before P and D can overlap on CUDA (issue 8; docs/PERF.md,
"The crossed-group stall on four H200s").

Native stacks of the crossed stall on two H200s showed the other path's thread blocked in the
driver at a *first use*: cuBLASLt setting a new kernel's attributes (cuKernelSetAttribute) and a
first cuDNN handle loading its modules (cuModuleLoadData). Both wait for a context-wide
synchronization, i.e. for every kernel on the GPU, including a collective spinning for a peer. So
every GEMM shape a path can issue runs once at start, for the M values cuBLASLt picks kernels by,
and cuDNN attention stays off in the ranks' processes, except for the bounded set of fresh-prompt
shapes `prefill_attention: hybrid` runs on it, all run once at start (warm_fresh_attention).
"""
from __future__ import annotations

import sys
import time

import torch


def gemm_shapes(model: torch.nn.Module) -> list[tuple[int, int, torch.dtype, bool]]:
    """The distinct (N, K, dtype, expert) of every matrix a forward multiplies by: 2-D weights
    (not embeddings, which are looked up) and each expert's slice of the 3-D expert weights."""
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out: dict[tuple, None] = {}
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() >= 2 and id(p) not in looked_up:
            out[(int(p.shape[-2]), int(p.shape[-1]), p.dtype, p.dim() == 3)] = None
    return list(out)


def warm_rows(m_max: int) -> list[int]:
    """The M values a GEMM warm-up runs: every M to 1024, every 8th to 8192, every 64th beyond
    (cuBLASLt's choice changes at thresholds; dense where batches are common, bounded in cost)."""
    return [m for m in range(1, m_max + 1)
            if m <= 1024 or (m <= 8192 and m % 8 == 0) or m % 64 == 0 or m == m_max]


def warm_gemms(model: torch.nn.Module, rows: int, expert_rows: int, device: torch.device) -> int:
    """x @ W.T for every GEMM shape of `model` and every M of `warm_rows` up to the rows that
    weight can see (`rows` for a forward's own tokens, `expert_rows` for an expert, which gets
    rows from every EP peer); returns the GEMM count."""
    n = 0
    for out_dim, k, dtype, expert in gemm_shapes(model):
        m_max = expert_rows if expert else rows
        w = torch.zeros(out_dim, k, dtype=dtype, device=device)
        x = torch.zeros(m_max, k, dtype=dtype, device=device)
        for m in warm_rows(m_max):
            torch.nn.functional.linear(x[:m], w)
            n += 1
    return n


def warm_kernels(model, stream, rows: int, ep: int, device: torch.device, rank: int) -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.monotonic()
    with torch.cuda.stream(stream):
        n = warm_gemms(model, rows, rows * ep, device)
    torch.cuda.synchronize(device)
    print(f"[rank {rank}] kernel warm-up: {n} GEMMs, M up to {rows} ({rows * ep} for experts), "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)


def warm_fresh_attention(model, rows: int, device: torch.device, rank: int) -> int:
    """`prefill_attention: hybrid`: every shape `fresh_prefill_attention` can run for a forward of
    up to `rows` tokens (at most SDPA_FRESH_MAX_TOKENS: larger steps run the launch), once now:
    cuDNN's first handle (its modules load with a context-wide wait) and each shape's plan (~45 ms)
    are built before P and D overlap. Returns the shapes run."""
    from ..model import backends
    from ..model.kernels import fresh_prefill_attention, fresh_shapes
    from ..model.qwen3_moe import SeqSlice
    rows = min(rows, backends.SDPA_FRESH_MAX_TOKENS)
    if rows < backends.SDPA_FRESH_MIN_TOKENS:
        return 0
    t0 = time.monotonic()
    attn = model.model.layers[0].self_attn
    dtype = model.model.embed_tokens.weight.dtype   # the activations' (FP8 checkpoints: not the weights')
    shapes = fresh_shapes(rows, backends.SDPA_FRESH_MIN_TOKENS)
    for n, length in shapes:
        q = torch.zeros(n * length, attn.heads, attn.head_dim, dtype=dtype, device=device)
        kv = torch.zeros(n * length, attn.kv_heads, attn.head_dim, dtype=dtype, device=device)
        seqs = [SeqSlice(i * length, length, length, torch.arange(i * length, (i + 1) * length, device=device))
                for i in range(n)]
        fresh_prefill_attention(q, kv, kv, seqs, attn.head_dim ** -0.5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"[rank {rank}] fresh attention warm-up: {len(shapes)} cuDNN shapes up to {rows} tokens, "
          f"{time.monotonic() - t0:.2f} s", file=sys.stderr, flush=True)
    return len(shapes)


def warm_nccl(pgs, device: torch.device) -> None:
    """Create every NCCL communicator now, in one order on every rank, before P and D run
    concurrently (a lazy first-use init inside a crossed order is avoidable risk)."""
    import torch.distributed as dist
    for pg in pgs:
        if pg is not None and dist.get_backend(pg) == "nccl":
            dist.all_reduce(torch.zeros(1, device=device), group=pg)
    torch.cuda.synchronize(device)

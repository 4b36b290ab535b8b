"""Rank-side body of the expert-communication test (importable by spawned ranks)."""
import threading


def expert_rank(ctx, iters: int = 6):
    import torch
    from pdrollout.engine.runtime.expert_comm import ExpertCommError, Phase, PendingDispatchError, PermitMissingError, TorchExpertComm, disjoint
    E, H, K, T = 8, 16, 2, 12
    comm = TorchExpertComm([list(range(ctx.world))], ctx.rank, num_experts=E, hidden=H, max_tokens=T, topk=K)
    g = torch.Generator().manual_seed(1234)
    W = torch.randn(E, H, H, generator=g) / H ** 0.5            # every rank knows all weights: reference
    lo = ctx.rank * comm.e_local

    def expert(e_local, rows):
        return rows @ W[lo + e_local]

    def batch(phase, i):
        gg = torch.Generator().manual_seed(hash((ctx.rank, phase, i)) % (2 ** 31))
        x = torch.randn(T, H, generator=gg)
        ids = torch.stack([torch.randperm(E, generator=gg)[:K] for _ in range(T)])
        w = torch.rand(T, K, generator=gg)
        ref = sum(w[:, j:j + 1] * torch.einsum("th,thk->tk", x, W[ids[:, j]]) for j in range(K))
        return x, ids, w, ref

    errs = {"P": 0.0, "D": 0.0}
    failures = []
    raised = {}   # class name -> the exit code a rank ending with it would take (protocol/exits.py)

    def seen(e):
        from pdrollout.engine.protocol.exits import exit_code
        raised[type(e).__name__] = exit_code(e)

    def p_path():  # normal path, split at the boundary, concurrently with D
        try:
            for i in range(iters):
                x, ids, w, ref = batch("P", i)
                pend = comm.notify(Phase.PREFILL, x, ids, w)
                try:
                    comm.notify(Phase.PREFILL, x, ids, w)
                    failures.append("second pending dispatch on one P buffer was accepted")
                except PendingDispatchError as e:
                    seen(e)
                try:
                    comm.move(pend)
                    failures.append("move without permit was accepted")
                except PermitMissingError as e:
                    seen(e)
                comm.wait_permit(pend, lambda: None)   # the turnstile permit (boundary) goes here
                recv, meta, h = comm.move(pend)
                out = comm.combine(Phase.PREFILL, comm.apply_experts(recv, meta, expert), h)
                errs["P"] = max(errs["P"], float((out - ref).abs().max()))
            # cancel: the buffer retires until the quiescent point
            x, ids, w, _ = batch("P", 99)
            pend = comm.notify(Phase.PREFILL, x, ids, w)
            comm.cancel(pend)
            retired = comm.state(Phase.PREFILL).status[:]
            try:
                comm.notify(Phase.PREFILL, x, ids, w)
                failures.append("notify on a retired buffer was accepted")
            except PendingDispatchError:
                pass
            freed = comm.quiesce()
            errs["cancel"] = (retired, freed, comm.state(Phase.PREFILL).status[:])
        except BaseException as e:
            failures.append(repr(e))

    t = threading.Thread(target=p_path)
    t.start()
    for i in range(iters * 2):  # low-latency path on the main thread, same time
        x, ids, w, ref = batch("D", i)
        recv, meta, h = comm.dispatch(Phase.DECODE, x, ids, w)
        out = comm.combine(Phase.DECODE, comm.apply_experts(recv, meta, expert), h)
        errs["D"] = max(errs["D"], float((out - ref).abs().max()))
    x, ids, w, _ = batch("D", 0)
    try:   # one token more than the D buffers were sized for, on every rank alike
        comm.dispatch(Phase.DECODE, torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]), torch.cat([w, w[:1]]))
        failures.append("LL dispatch over the D capacity was accepted")
    except ExpertCommError as e:
        seen(e)
        if "capacity of 12 tokens" not in str(e):
            failures.append(f"unclear capacity error: {e}")
    recv, meta, h = comm.dispatch(Phase.DECODE, x, ids, w)   # and D keeps working
    comm.combine(Phase.DECODE, comm.apply_experts(recv, meta, expert), h)
    # Padding rows (ADP>1 shares) route nowhere and come back as zeros; D's exchange reads nothing
    # back to the host (the slots keep their layout), so its iteration can be enqueued ahead.
    x, ids, w, ref = batch("D", 7)
    valid = torch.arange(T) < T - 3
    reads = []
    real_read = comm.reader.read
    comm.reader.read = lambda *a: reads.append(a) or real_read(*a)
    recv, meta, h = comm.dispatch(Phase.DECODE, x, ids, w, valid=valid)
    d_reads = len(reads)
    comm.reader.read = real_read
    out = comm.combine(Phase.DECODE, comm.apply_experts(recv, meta, expert), h)
    errs["D_valid"] = float((out[valid] - ref[valid]).abs().max())
    errs["D_padding"] = float(out[~valid].abs().max())
    errs["D_reads"] = (d_reads, meta.layout, tuple(recv.shape))
    t.join(120)
    p, d = comm.state(Phase.PREFILL), comm.state(Phase.DECODE)
    return {"errs": errs, "failures": failures, "disjoint": disjoint(p, d),
            "qp": (list(p.qp_range), list(d.qp_range)), "ll_index": d.ll_index,
            "alive": t.is_alive(), "raised": raised}

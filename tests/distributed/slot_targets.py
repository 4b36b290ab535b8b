"""Rank-side body of the token-slot tests, P's and D's (importable by spawned ranks)."""


def slots_rank(ctx, dtype_name: str = "float32", phase_name: str = "prefill"):
    import torch
    from pdrollout.engine.model import ops
    from pdrollout.engine.runtime.expert_comm import ExpertCommError, Phase, TorchExpertComm
    dtype, phase = getattr(torch, dtype_name), Phase(phase_name)
    E, H, I, K, BOUND = 8, 16, 12, 3, 10
    comm = TorchExpertComm([list(range(ctx.world))], ctx.rank, num_experts=E, hidden=H, max_tokens=BOUND,
                           topk=K, dtype=dtype, d_max_tokens=BOUND)
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)   # every rank knows all
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    lo, el = ctx.rank * comm.e_local, comm.e_local
    out = {"err": [], "zero_rows": [], "issued": [], "reads": None}
    for i in range(4):
        gg = torch.Generator().manual_seed(100 * ctx.rank + i)
        t = [BOUND, 3, 0, 7][(ctx.rank + i) % 4]               # ranks send different row counts
        x = torch.randn(t, H, generator=gg).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=gg)[:K] for _ in range(t)]) if t else \
            torch.zeros(0, K, dtype=torch.long)
        if t:
            ids[0, 1:] = -1                                    # a row routed to one expert only
        w = torch.rand(t, K, generator=gg).to(dtype)
        valid = torch.ones(t, dtype=torch.bool)
        if t > 2:
            valid[2] = False                                   # padding: routed nowhere
        ref = ops.experts_reference(x, ids, w, gate_up, down) * valid[:, None]
        before, sent = comm.state(phase).issued, comm.state(phase).sent
        recv, meta, handle = comm.dispatch(phase, x, ids, w, rows=BOUND, valid=valid)
        part = ops.experts_reference(recv, meta.expert_ids, meta.weights, gate_up[lo:lo + el], down[lo:lo + el], lo)
        y = comm.combine(phase, part, handle)
        out["issued"].append(comm.state(phase).issued - before)
        out.setdefault("sent", []).append(comm.state(phase).sent - sent)
        out["err"].append(float((y.float() - ref.float()).abs().max()) if t else 0.0)
        if t > 2:
            out["zero_rows"].append(float(y[2].abs().max()))
    out["reads"] = dict(comm.reader.reads)
    try:
        comm.dispatch(phase, torch.zeros(BOUND + 1, H, dtype=dtype),
                      torch.zeros(BOUND + 1, K, dtype=torch.long), torch.zeros(BOUND + 1, K, dtype=dtype),
                      rows=BOUND + 1)
        out["over"] = None
    except ExpertCommError as e:
        out["over"] = str(e)
    return out


def capture_rank(ctx, tokens: int = 512):
    """One EP rank's P MoE layer at Qwen3-30B-A3B's expert shape (8 local experts of 128 under
    EP16, hidden 2048, moe_intermediate 768, top-8) on one GPU: its exchange (a world of one NCCL
    rank), experts and combine captured as one CUDA graph."""
    import torch
    from pdrollout.engine.model.backends import AutoExperts
    from pdrollout.engine.runtime.expert_comm import Phase, TorchExpertComm
    torch.cuda.set_device(0)
    E, LOCAL, H, I, K = 128, 8, 2048, 768, 8
    dt = torch.bfloat16
    comm = TorchExpertComm([[0]], 0, num_experts=E, hidden=H, max_tokens=tokens, topk=K, dtype=dt,
                           device="cuda", pg_backend="nccl")
    experts = AutoExperts()
    g = torch.Generator(device="cuda").manual_seed(3)
    gate_up = torch.randn(LOCAL, 2 * I, H, device="cuda", generator=g, dtype=dt) / H ** 0.5
    down = torch.randn(LOCAL, H, I, device="cuda", generator=g, dtype=dt) / I ** 0.5

    def inputs(seed):
        gg = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, H, device="cuda", generator=gg, dtype=dt)
        # half the pairs on this rank's experts, so every token has work here and elsewhere
        ids = torch.where(torch.rand(tokens, K, device="cuda", generator=gg) < 0.5,
                          torch.randint(0, LOCAL, (tokens, K), device="cuda", generator=gg),
                          torch.randint(LOCAL, E, (tokens, K), device="cuda", generator=gg))
        w = torch.rand(tokens, K, device="cuda", generator=gg).to(dt)
        return x, ids, w

    def layer(x, ids, w, rows=tokens):
        recv, meta, handle = comm.dispatch(Phase.PREFILL, x, ids, w, rows=rows)
        return comm.combine(Phase.PREFILL, experts(recv, meta.expert_ids, meta.weights, gate_up, down), handle)

    x, ids, w = inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):           # Triton compiles, NCCL's first use
            layer(x, ids, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):    # capture_error_mode "global": a host sync ends it with an error
        y = layer(x, ids, w)
    out = {"diffs": []}
    for seed in (1, 2, 3):
        nx, nids, nw = inputs(seed)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        graph.replay()
        ref = experts(nx, nids, nw, gate_up, down)    # one rank: the same experts, no exchange
        torch.cuda.synchronize()
        out["diffs"].append(float((y.float() - ref.float()).abs().max()))
        out["scale"] = float(ref.float().abs().max())
    out["reads"] = dict(comm.reader.reads)
    # The counted path reads P's counts back on the host: its capture must fail
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            recv, meta, handle = comm.dispatch(Phase.PREFILL, x, ids, w)
        out["counted"] = "captured"
    except Exception as e:   # torch/CUDA raise several types for an illegal op under capture
        out["counted"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def pieces_rank(ctx, model_dir: str | None):
    """P's whole forward through the multi-rank path (RankCollectives over a one-rank NCCL group,
    its expert exchange in token slots) captured as P's piecewise graphs on one GPU; logits and K/V
    against the one-rank eager forward. `model_dir` None: one EP16 rank of Qwen3-30B-A3B (its 8 of
    128 experts, full attention, two layers, random weights): the others' experts add nothing."""
    import torch
    from pdrollout.engine.model.backends import make_backends
    from pdrollout.engine.model.checkpoint import random_model
    from pdrollout.engine.model.kv_cache import KVCache
    from pdrollout.engine.model.loader import load_model
    from pdrollout.engine.model.qwen3_moe import Collectives, Shard
    from prefill_batch import batch_of
    from pdrollout.engine.protocol.config import ModelConfig, load_preset
    from pdrollout.engine.protocol.topology import Topology
    from pdrollout.engine.runtime.collectives import PathContext, RankCollectives, make_groups
    from pdrollout.engine.runtime.expert_comm import TorchExpertComm
    from pdrollout.engine.runtime.prefill_graphs import PrefillGraphs
    from pdrollout.engine.runtime.streams import StreamDevice
    torch.cuda.set_device(0)
    dev, dt, block = torch.device("cuda"), torch.bfloat16, 4
    backends = make_backends(dev, dt)
    if model_dir is None:
        cfg = ModelConfig.from_dict({**load_preset("qwen3-30b-a3b"), "num_hidden_layers": 2})
        model = random_model(cfg, dev, dt, seed=0, shard=Shard(ep_rank=0, ep_size=16), backends=backends)
    else:
        model = load_model(model_dir, device=dev, dtype=dt, backends=backends)
    cfg = model.cfg
    topo = Topology(1)
    comm = TorchExpertComm([[0]], 0, num_experts=cfg.num_experts, hidden=cfg.hidden_size, max_tokens=64,
                           topk=cfg.num_experts_per_tok, dtype=dt, device=dev, pg_backend="nccl")
    col = RankCollectives(topo, 0, make_groups(topo, 0, backend="nccl"), comm, StreamDevice(), lambda: None,
                          cfg.hidden_size, cfg.num_experts_per_tok, 64)
    col.cuda = True
    kv_of = lambda: KVCache(cfg.num_hidden_layers, 64, block, model.model.layers[0].self_attn.kv_heads,
                            cfg.head_dim, dt, dev)
    kv_ref, kv = kv_of(), kv_of()
    model.collectives = col
    graphs = PrefillGraphs(model, kv, 64, collectives=col, replicas=1)
    graphs.capture()
    a = [(i * 37) % 500 + 2 for i in range(40)]
    out = {"logits": [], "kv": 0.0}
    for step, segs in enumerate(([(a[:30], 0, 0), (a[:9], 0, 128)], [(a[30:], 30, 0)], [(a[9:20], 9, 128)])):
        batch = batch_of(segs, dev)
        t = batch.input_ids.shape[0]
        model.collectives = col
        col.begin("p", PathContext(step, [t]))
        got = graphs.forward(batch, shared=t)
        model.collectives = Collectives()   # one rank, eager
        ref = model(batch, kv_ref)
        out["logits"].append(float((got - ref).abs().max()))
        out["scale"] = max(out.get("scale", 0.0), float(ref.abs().max()))
    null = kv.null_slot
    out["kv"] = max(float((kv.k[i][:null].float() - kv_ref.k[i][:null].float()).abs().max())
                    for i in range(cfg.num_hidden_layers))
    out["replays"], out["reads"] = graphs.replays, dict(comm.reader.reads)
    out["pieces"] = {b: len(p) for b, p in graphs.pieces.items()}
    return out

"""Pure network/NVSHMEM environment for phase-owned expert communication (docs/DISTRIBUTED.md).

Stdlib only: the Kubernetes operator imports this module for its env injection, and the
DeepEP backend uses the same functions, so the two can never disagree. Nothing here touches
a GPU, a NIC or the process environment; callers apply the returned dicts.

QP split (paper, Figure 5): one process-level NVSHMEM runtime per rank; the D low-latency
buffer owns QP indices [0, s), the P normal buffer [s, 2s). NVSHMEM therefore needs 2s RC
QPs per PE, where s is the number of local experts (DeepEP's num_qps_per_rank for LL).
"""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 128  # DeepEP aligns buffer sizes to 128 bytes
DEEP_EP_INTRANODE_RANKS = (2, 4, 8)   # stock DeepEP's intranode normal kernels (the CR checks it too)


@dataclass(frozen=True)
class QPSplit:
    decode: range    # [0, s)
    prefill: range   # [s, 2s)

    @property
    def total(self) -> int:
        return len(self.decode) + len(self.prefill)


def qp_split(qps_per_phase: int) -> QPSplit:
    if qps_per_phase < 1:
        raise ValueError(f"qps_per_phase must be >= 1, got {qps_per_phase}")
    s = qps_per_phase
    return QPSplit(decode=range(0, s), prefill=range(s, 2 * s))


QP_RANGE_ENV = {"decode": "PDROLLOUT_QP_RANGE_D", "prefill": "PDROLLOUT_QP_RANGE_P"}


def format_range(r: range) -> str:
    return f"{r.start}:{r.stop}"   # half-open, as PDROLLOUT_QP_RANGE_* holds it


def qp_split_from_env(env, local_experts: int) -> QPSplit:
    """The QP split the operator injected (PDROLLOUT_QP_RANGE_D/P, from spec.network.nvshmem.qpsPerRank),
    checked against what the low-latency kernels need; the engine's own split when absent."""
    raw = {ph: env.get(key) for ph, key in QP_RANGE_ENV.items()}
    if not any(raw.values()):
        return qp_split(local_experts)
    if not all(raw.values()):
        raise ValueError(f"set both or neither of {' and '.join(QP_RANGE_ENV.values())}, got {raw}")
    ranges = {}
    for ph, text in raw.items():
        try:
            a, b = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"{QP_RANGE_ENV[ph]}={text!r} is not a half-open range 'start:stop'") from None
        ranges[ph] = range(a, b)
    split = qp_split(len(ranges["decode"]))
    if (ranges["decode"], ranges["prefill"]) != (split.decode, split.prefill):
        raise ValueError(f"QP ranges D {raw['decode']} and P {raw['prefill']} must be [0, s) and [s, 2s)")
    if len(split.decode) < local_experts:
        raise ValueError(f"D's QP range {raw['decode']} holds {len(split.decode)} QPs, but the low-latency kernels use "
                         f"one per local expert ({local_experts}): raise spec.network.nvshmem.qpsPerRank")
    rc = env.get("NVSHMEM_IBGDA_NUM_RC_PER_PE")
    if rc not in (None, "", str(split.total)):
        raise ValueError(f"NVSHMEM_IBGDA_NUM_RC_PER_PE={rc} but the QP ranges need {split.total} (2s)")
    return split


def local_experts(num_experts: int, ep: int) -> int:
    if ep < 1 or num_experts % ep:
        raise ValueError(f"{num_experts} experts do not divide over EP {ep}")
    return num_experts // ep


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def ll_rdma_bytes_hint(max_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                       elem_bytes: int = 2) -> int:
    """Upper-bound sizing of the D low-latency RDMA buffer: two buffers (LL double-buffering),
    each holding dispatch send/recv and combine send/recv for every (expert, token) slot, plus
    per-expert signalling counters. A hint for memory planning; on GPU the DeepEP backend asks
    deep_ep for its exact figure when available."""
    msg = 16 + hidden * elem_bytes + 16             # header + payload + scales/padding
    send = max_tokens_per_rank * msg
    recv = num_experts * max_tokens_per_rank * msg
    signal = num_experts * 4 * 2
    per_buffer = 2 * (send + recv) + signal         # dispatch and combine halves
    return _align(2 * per_buffer)


def normal_nvl_bytes_hint(max_tokens: int, hidden: int, num_ranks: int, topk: int,
                          elem_bytes: int = 2) -> int:
    """Sizing of the P normal (NVLink) buffer: every local token may reach every peer once,
    with its top-k ids and weights."""
    row = hidden * elem_bytes + topk * (8 + 4) + 16
    return _align(num_ranks * max_tokens * row)


def hca_list(devices: list[str], port: int = 1) -> str:
    """'mlx5_0:1,mlx5_1:1' for NVSHMEM_HCA_LIST / NCCL_IB_HCA."""
    return ",".join(d if ":" in d else f"{d}:{port}" for d in devices)


def nvshmem_env(qps_per_phase: int, *, qp_depth: int = 1024, max_teams: int = 7,
                cumem_granularity: int = 1 << 29, internode: bool = False,
                hcas: list[str] | None = None, gid_index: int | None = None,
                nic_pe_mapping: bool = False) -> dict[str, str]:
    """NVSHMEM variables for one runtime shared by both phases (2s QPs per PE).
    Single node (internode=False): NVLink P2P carries LL traffic, IBGDA stays off."""
    split = qp_split(qps_per_phase)
    if qp_depth < 1 or qp_depth & (qp_depth - 1):
        raise ValueError(f"qp_depth must be a power of two, got {qp_depth}")
    env = {
        "NVSHMEM_IB_ENABLE_IBGDA": "1" if internode else "0",
        "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(split.total),
        "NVSHMEM_QP_DEPTH": str(qp_depth),
        "NVSHMEM_DISABLE_NVLS": "1",
        "NVSHMEM_MAX_TEAMS": str(max_teams),
        "NVSHMEM_CUMEM_GRANULARITY": str(cumem_granularity),
        "NVSHMEM_DISABLE_P2P": "0",
    }
    if hcas:
        env["NVSHMEM_HCA_LIST"] = hca_list(hcas)
    if gid_index is not None:
        env["NVSHMEM_IB_GID_INDEX"] = str(gid_index)
    if nic_pe_mapping:
        env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] = "1"
    return env


def nccl_env(hcas: list[str] | None = None, socket_ifname: str | None = None,
             gid_index: int | None = None) -> dict[str, str]:
    env = {"NCCL_NVLS_ENABLE": "0"}  # keep NVLink multicast off (see the device notes)
    if hcas:
        env["NCCL_IB_HCA"] = hca_list(hcas)
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = socket_ifname
    if gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(gid_index)
    return env


def expert_comm_env(num_experts: int, ep: int, nodes: int = 1, **kw) -> dict[str, str]:
    """Everything a rank needs for phase-owned DeepEP: s = local experts per rank."""
    s = local_experts(num_experts, ep)
    nv = {k: kw[k] for k in ("qp_depth", "max_teams", "cumem_granularity", "gid_index",
                             "nic_pe_mapping") if k in kw}
    env = nvshmem_env(s, internode=nodes > 1, hcas=kw.get("hcas"), **nv)
    env.update(nccl_env(kw.get("hcas"), kw.get("socket_ifname"), kw.get("gid_index")))
    return env

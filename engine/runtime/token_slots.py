"""The expert exchange with no host read, P's and D's (each phase its own slots): each token sent once
to every peer that holds one of its experts, into fixed per-peer slots sized by the pass's rank-shared
row bound (docs/DISTRIBUTED.md, "P's expert exchange", "D's expert exchange").

The counted path (notify -> counts on the host -> variable all-to-all) made P's thread wait for
the GPU at every MoE layer, so it could never run ahead of its kernels nor be captured as a graph.
Here a slot's position comes from a prefix sum on the device and the exchange has one shape for a
given bound, so nothing is read back:
  send  [ep (+1 spare), rows, H + 2k]      the token, its k global expert ids (bits of an integer
                                            of the rows' width) and its k weights
  recv  [ep, rows, ...]                     every sender's slots; an empty slot has ids -1
  the receiver runs its local experts over all its slots (foreign and -1 ids add nothing) and
  sends back one weighted partial sum a slot; the sender adds its peers' partials in fp32.
Bytes: each rank sends ep × rows rows a pass where the counted path sent (token, expert) pairs,
k × rows: fewer up to EP k (8 for Qwen3), twice as many at EP16.
"""
from __future__ import annotations

import torch

_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class TokenSlots:
    """One rank's slots of one phase over its EP group; `exchange(out, inp)`: the group's all-to-all."""

    def __init__(self, ep: int, e_local: int, hidden: int, topk: int, max_rows: int, dtype, device) -> None:
        self.ep, self.e_local, self.hidden, self.topk, self.max_rows = ep, e_local, hidden, topk, max_rows
        self.dtype, self.device = dtype, torch.device(device)
        self.int = _INT_OF[torch.empty((), dtype=dtype).element_size()]
        self.width = hidden + 2 * topk   # the weights travel in the rows' dtype: the model routes in it
        n = max_rows
        z = lambda *s: torch.zeros(*s, dtype=dtype, device=self.device)
        self.buffers = {"send": z((ep + 1) * n * self.width), "recv": z(ep * n * self.width),
                        "back": z((ep + 1) * n * hidden)}

    def _view(self, name: str, peers: int, rows: int, width: int) -> torch.Tensor:
        return self.buffers[name][:peers * rows * width].view(peers, rows, width)

    def dispatch(self, exchange, hidden, topk_ids, topk_weights, rows: int, valid=None):
        """(received tokens [ep·rows, H], their global ids [ep·rows, k], weights, state for combine);
        the caller checks hidden.shape[0] <= rows <= max_rows."""
        ep, H, k, t = self.ep, self.hidden, self.topk, hidden.shape[0]
        dev = self.device
        ids = topk_ids.long()
        dest = torch.where(ids >= 0, ids // self.e_local, ep)            # -1 (no expert): nowhere
        hit = torch.zeros(t, ep + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :ep]
        if valid is not None:
            hit &= valid.reshape(t, 1)
        pos = torch.cumsum(hit, 0) - 1                                    # the token's slot at each peer
        tok = torch.arange(t, device=dev)
        peer = torch.where(hit, torch.arange(ep, device=dev)[None, :], ep)   # not sent: the spare row
        slot = torch.where(hit, pos, tok[:, None])
        send = self._view("send", ep + 1, rows, self.width)
        bits = send.view(self.int)
        bits[:ep, :, H:H + k].fill_(-1)                                   # empty slots route nowhere
        send[peer, slot, :H] = hidden.to(self.dtype)[:, None, :].expand(t, ep, H)
        bits[peer, slot, H:H + k] = ids.to(self.int)[:, None, :].expand(t, ep, k)
        send[peer, slot, H + k:] = topk_weights.to(self.dtype)[:, None, :].expand(t, ep, k)
        recv = self._view("recv", ep, rows, self.width)
        exchange(recv, send[:ep])
        flat = recv.reshape(ep * rows, self.width)
        got_ids = flat.view(self.int)[:, H:H + k].long()
        got_w = flat[:, H + k:].contiguous()
        state = {"kind": "tokens", "rows": rows, "index": torch.where(hit, peer * rows + slot, ep * rows + tok[:, None])}
        return flat[:, :H].contiguous(), got_ids, got_w, state

    def combine(self, exchange, partial, state) -> torch.Tensor:
        """Every peer's weighted partial sums back to their tokens, added in fp32 in peer order."""
        ep, rows, H = self.ep, state["rows"], self.hidden
        back = self._view("back", ep + 1, rows, H)
        back[ep].zero_()                                                  # what unsent pairs read
        exchange(back[:ep], partial.to(self.dtype).reshape(ep, rows, H).contiguous())
        flat = back.reshape((ep + 1) * rows, H)
        index = state["index"]
        out = torch.zeros(index.shape[0], H, dtype=torch.float32, device=self.device)
        for p in range(ep):
            out += flat.index_select(0, index[:, p]).float()
        return out.to(self.dtype)

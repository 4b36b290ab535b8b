"""The paged KV cache storage: per-layer K and V tensors of [slots, kv heads, head dim]."""
from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V storage: [(num_blocks + 1) * block_size, kv_heads, head_dim]. The extra
    block is never handed out: padding rows of a CUDA graph write their K/V into its first slot."""

    def __init__(self, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
        self.block_size = block_size
        self.null_slot = num_blocks * block_size
        self.shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]

    # memory release (/release_memory_occupation): the content is gone; resume brings zeroed storage
    def release(self) -> None:
        self.k = [t.new_empty(0) for t in self.k]
        self.v = [t.new_empty(0) for t in self.v]

    def resume(self) -> None:
        self.k = [torch.zeros(self.shape, dtype=t.dtype, device=t.device) for t in self.k]
        self.v = [torch.zeros(self.shape, dtype=t.dtype, device=t.device) for t in self.v]

    def resize(self, num_blocks: int) -> None:
        """Zeroed storage for `num_blocks` in place of the current (whoever holds this cache sees it;
        graphs that read the old storage must be captured again)."""
        self.release()
        self.null_slot = num_blocks * self.block_size
        self.shape = ((num_blocks + 1) * self.block_size, *self.shape[1:])
        self.resume()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

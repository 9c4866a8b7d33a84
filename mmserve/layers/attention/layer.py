"""The paged-attention layer a model's decoder layers hold."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.layers.attention.torch_backend import TorchAttentionBackend


class Attention(nn.Module):
    """Paged attention of one decoder layer: stores this step's keys and values in the layer's KV
    cache, then attends each request's queries over its context. The backend that runs it is set
    on the built model (`mmserve.worker.kernel_plan`); until then, the torch reference."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads  # this rank's
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        return self.backend.forward(q, k, v, kv_cache, metadata, self.scale)

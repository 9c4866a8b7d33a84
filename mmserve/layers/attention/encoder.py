"""Attention of an encoder (a vision tower): bidirectional within each segment of a packed batch
of items (an image, a frame, a window), on the kernel set's varlen op."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.kernel_user import UsesKernels


class EncoderAttention(UsesKernels, nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [N, H, D]
        k: torch.Tensor,  # [N, H, D]
        v: torch.Tensor,  # [N, H, D]
        cu_seqlens: list[int],  # segment s is rows [cu_seqlens[s], cu_seqlens[s + 1])
    ) -> torch.Tensor:  # [N, H, D]
        return self.kernels.varlen_attention(q, k, v, cu_seqlens, self.scale)

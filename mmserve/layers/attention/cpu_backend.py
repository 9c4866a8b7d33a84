"""Paged attention with the C++ CPU kernels (csrc/): one call per layer for the whole step,
straight over the block table — decode rows and prompt chunks alike, no gathered context."""

from __future__ import annotations

import torch

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.ops import cpu
from mmserve.ops.kernels import cpu_kernels


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.kernels = cpu_kernels()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        cpu.write_kv(k, v, kv_cache, metadata.slot_mapping)
        return cpu.paged_attention(
            q, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table, scale
        )

"""Paged attention with the Triton kernels: one unified launch per layer for a mixed step (two
with split-KV for long contexts), grid sizes from the host-side maxima, no device sync."""

from __future__ import annotations

import torch

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.ops.kernels import triton_kernels


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from mmserve.ops import triton as triton_ops

        self.kernels = triton_kernels()
        self._ops = triton_ops

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._ops.write_kv(k, v, kv_cache, metadata.slot_mapping)
        return self._ops.paged_attention(
            q,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )

"""Paged attention with flash-attn's varlen kernel over the block table (CUDA, fp16 / bf16).

The step's keys and values are stored with the Triton KV write (flash-attn's varlen function
only reads the cache); the other layers run the Triton kernel set, with the vision tower's
packed windows through flash-attn's varlen kernel as well.
"""

from __future__ import annotations

import dataclasses

import torch

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.ops import flash_attn
from mmserve.ops.kernels import triton_kernels


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from mmserve.ops import triton as triton_ops

        self.kernels = dataclasses.replace(
            triton_kernels(), name="flash_attn", varlen_attention=flash_attn.varlen_attention
        )
        self._write_kv = triton_ops.write_kv

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._write_kv(k, v, kv_cache, metadata.slot_mapping)
        return flash_attn.paged_attention(
            q,
            kv_cache,
            metadata.query_start_loc,
            # Per layer, not cached per step: a tiny kernel, and no state that a reused metadata
            # buffer could make stale.
            flash_attn.cumulative_lengths(metadata.seq_lens),
            metadata.block_table,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )

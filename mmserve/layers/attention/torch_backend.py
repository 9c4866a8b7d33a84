"""Paged attention in plain torch: the reference every other backend is tested against.

Decode rows (one query token) are attended together in one padded batch; prompt chunks are
attended one request at a time with a causal mask offset by their already-cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.ops.kernels import TORCH_KERNELS


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values: kv_cache[:, slot // block_size, slot % block_size] = k, v."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache: [num_blocks_total, block_size, KVH, D], block_table: [R, ≥num_blocks]
    → [R, num_blocks * block_size, KVH, D] (positions past a request's length are junk)."""
    blocks = block_table[:, :num_blocks].long()
    gathered = cache[blocks]  # [R, num_blocks, block_size, KVH, D]
    return gathered.flatten(1, 2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    kernels = TORCH_KERNELS

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        starts = metadata.query_start_loc_cpu
        query_lens = starts[1:] - starts[:-1]
        decode_rows = (query_lens == 1).nonzero()[0]
        if len(decode_rows):
            self._decode(q, kv_cache, metadata, decode_rows, scale, out)
        for r in (query_lens > 1).nonzero()[0]:
            self._prefill_one(q, kv_cache, metadata, int(r), scale, out)
        return out

    def _decode(self, q, kv_cache, metadata, rows, scale, out) -> None:
        block_size = kv_cache.shape[2]
        rows_t = torch.from_numpy(rows).to(q.device)
        seq_lens = metadata.seq_lens[rows_t]
        max_len = int(metadata.seq_lens_cpu[rows].max())
        num_blocks = -(-max_len // block_size)
        table = metadata.block_table[rows_t]
        keys = gather_context(kv_cache[0], table, num_blocks)  # [Rd, S, KVH, D]
        values = gather_context(kv_cache[1], table, num_blocks)
        token_idx = torch.from_numpy(metadata.query_start_loc_cpu[rows]).to(q.device).long()
        queries = q[token_idx]  # [Rd, H, D]
        valid = torch.arange(keys.shape[1], device=q.device)[None, :] < seq_lens[:, None]  # [Rd, S]
        attn = F.scaled_dot_product_attention(
            queries[:, :, None, :],  # [Rd, H, 1, D]
            keys.transpose(1, 2),  # [Rd, KVH, S, D]
            values.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out[token_idx] = attn[:, :, 0, :]

    def _prefill_one(self, q, kv_cache, metadata, r, scale, out) -> None:
        block_size = kv_cache.shape[2]
        start, end = int(metadata.query_start_loc_cpu[r]), int(metadata.query_start_loc_cpu[r + 1])
        query_len = end - start
        seq_len = int(metadata.seq_lens_cpu[r])
        num_blocks = -(-seq_len // block_size)
        table = metadata.block_table[r : r + 1]
        keys = gather_context(kv_cache[0], table, num_blocks)[0, :seq_len]  # [S, KVH, D]
        values = gather_context(kv_cache[1], table, num_blocks)[0, :seq_len]
        queries = q[start:end].transpose(0, 1)[None]  # [1, H, Q, D]
        keys = keys.transpose(0, 1)[None]
        values = values.transpose(0, 1)[None]
        if seq_len == query_len:
            attn = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query i sits at absolute position (seq_len - query_len + i) and sees keys up to it.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [Q, S]
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[start:end] = attn[0].transpose(0, 1)

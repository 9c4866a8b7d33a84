"""The flash_attn backend's call into flash-attn, on the CPU, through a stand-in module.

flash-attn cannot be installed here (CUDA-only wheels). The stand-in implements
`flash_attn_varlen_func` as flash-attn documents it (packed queries by `cu_seqlens_q`, context
lengths by `cu_seqlens_k`, paged keys/values [num_blocks, page, KVH, D] through `block_table`,
causal aligned to the end of the context, GQA by head groups) and checks the argument types it
requires. So this tests what the backend passes, not flash-attn; benchmarks/gpu_check.py
compares the real kernel to the reference on a GPU.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.ops import flash_attn as flash_attn_ops
from mmserve.ops import reference

pytest.importorskip("triton")  # the backend stores keys and values with the Triton kernel


def documented_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table=None
):
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert causal and block_table is not None and block_table.dtype == torch.int32
    assert k.dim() == 4 and k.shape == v.shape and k.stride(-1) == 1  # [num_blocks, page, KVH, D]
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for b in range(len(q_starts) - 1):
        queries = q[q_starts[b] : q_starts[b + 1]].float()  # [Q, H, D]
        num_queries, length = queries.shape[0], k_starts[b + 1] - k_starts[b]
        assert num_queries <= max_seqlen_q and length <= max_seqlen_k
        keys = k[block_table[b].long()].flatten(0, 1)[:length].float()  # [L, KVH, D]
        values = v[block_table[b].long()].flatten(0, 1)[:length].float()
        group = q.shape[1] // k.shape[2]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * softmax_scale
        visible = torch.arange(length)[None, :] <= torch.arange(length - num_queries, length)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q_starts[b] : q_starts[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(
            q.dtype
        )
    return out


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = documented_varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    flash_attn_ops._module.cache_clear()
    yield
    flash_attn_ops._module.cache_clear()


def paged_step(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    ids = rng.permutation(sum(blocks) + 3).astype(np.int32)  # out of order, with unused blocks
    table = np.zeros((len(seq_lens), max(blocks)), dtype=np.int32)
    offsets = np.cumsum([0, *blocks])
    slots = []
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        table[r, : blocks[r]] = ids[offsets[r] : offsets[r + 1]]
        positions = np.arange(s_len - q_len, s_len)
        slots.append(table[r, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k, v = torch.randn(2, num_tokens, kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, len(ids), block_size, kv_heads, head_dim, generator=gen)
    starts = np.cumsum([0, *query_lens])
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        query_start_loc_cpu=starts,
        seq_lens_cpu=np.array(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return q, k, v, cache, metadata


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_the_backend_gives_flash_attn_the_step_as_documented(stand_in, heads, kv_heads):
    from mmserve.layers.attention.flash_attn_backend import FlashAttnBackend

    q, k, v, cache, metadata = paged_step(
        [1, 9, 1, 30], [600, 9, 257, 300], heads, kv_heads, 32, 256, seed=heads
    )
    expected_cache = cache.clone()
    reference.write_kv(k, v, expected_cache, metadata.slot_mapping)
    expected = reference.paged_attention(
        q, expected_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table, 0.2
    )
    got = FlashAttnBackend().forward(q, k, v, cache, metadata, 0.2)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_context_prefix_sums_start_at_zero():
    assert flash_attn_ops.cumulative_lengths(torch.tensor([3, 1, 5], dtype=torch.int32)).tolist() == [
        0,
        3,
        4,
        9,
    ]

"""The paged torch attention backend against dense causal attention over the same sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.attention.torch_backend import TorchAttentionBackend

H, KVH, D, BLOCK = 4, 2, 16, 4


def dense(q, k, v):
    """q: [S, H, D] over k, v: [S, KVH, D], plain causal attention with repeated kv heads."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("seed", range(5))
def test_paged_attention_over_chunks_equals_dense_attention(seed):
    """Random requests, random non-contiguous blocks, prompts fed in random chunks mixed with decodes."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=5)
    seqs = [(torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)) for n in lengths]
    num_blocks = 128
    free = list(rng.permutation(num_blocks))
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    cache = torch.zeros(2, num_blocks, BLOCK, KVH, D)
    backend = TorchAttentionBackend()
    done = [0] * len(lengths)
    outputs = [torch.empty(n, H, D) for n in lengths]
    while any(d < n for d, n in zip(done, lengths)):
        live = [i for i, (d, n) in enumerate(zip(done, lengths)) if d < n]
        spans = {i: int(rng.integers(1, lengths[i] - done[i] + 1)) for i in live}
        q = torch.cat([seqs[i][0][done[i] : done[i] + s] for i, s in spans.items()])
        k = torch.cat([seqs[i][1][done[i] : done[i] + s] for i, s in spans.items()])
        v = torch.cat([seqs[i][2][done[i] : done[i] + s] for i, s in spans.items()])
        starts = np.concatenate([[0], np.cumsum(list(spans.values()))])
        seq_lens = np.array([done[i] + s for i, s in spans.items()])
        slots = np.concatenate(
            [
                [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(done[i], done[i] + s)]
                for i, s in spans.items()
            ]
        )
        width = max(len(t) for t in tables)
        table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in spans], dtype=torch.int32)
        meta = AttentionMetadata(
            num_tokens=int(starts[-1]),
            query_start_loc=torch.from_numpy(starts).int(),
            seq_lens=torch.from_numpy(seq_lens).int(),
            block_table=table,
            slot_mapping=torch.from_numpy(slots).long(),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            max_query_len=int(max(spans.values())),
            max_seq_len=int(seq_lens.max()),
        )
        out = backend.forward(q, k, v, cache, meta, scale=D**-0.5)
        for j, (i, s) in enumerate(spans.items()):
            outputs[i][done[i] : done[i] + s] = out[starts[j] : starts[j + 1]]
            done[i] += s
    for (q, k, v), got in zip(seqs, outputs):
        torch.testing.assert_close(got, dense(q, k, v), rtol=1e-5, atol=1e-5)

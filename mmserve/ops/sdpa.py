"""Attention kernels written with torch's scaled_dot_product_attention (the torch kernel set's)."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import torch
import torch.nn.functional as F


def varlen_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """`reference.varlen_attention` (bidirectional within packed segments: a vision tower's
    images or windows). q, k, v: [N, H, D]; segment s is rows [cu_seqlens[s], cu_seqlens[s+1]).

    Segments of equal length are stacked and attended in one call, so an image cut into
    many same-sized windows costs a handful of kernel launches, not one per window. Where they
    lie back to back (one image; a run of equal windows) the stack is a view, not a gather.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in pairwise(cu_seqlens):
        if end > start:
            by_length[end - start].append(start)
    out = torch.empty_like(q)
    for length, starts in by_length.items():
        shape = (len(starts), length, q.shape[1], q.shape[2])  # [S, L, H, D]
        if starts == list(range(starts[0], starts[0] + len(starts) * length, length)):
            rows = slice(starts[0], starts[0] + len(starts) * length)
            qs, ks, vs = (t[rows].view(shape).transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
            attn = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[rows].view(shape).copy_(attn.transpose(1, 2))
            continue
        index = (
            torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)
        ).flatten()
        qs, ks, vs = (t[index].view(shape).transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
        attn = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out[index] = attn.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
    return out

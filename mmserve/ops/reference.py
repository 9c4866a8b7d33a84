"""Plain torch references for every kernel in `mmserve.ops`: slow, obvious, and the oracle.

Each compiled or Triton kernel has a property test against the function of the same name here
(random ragged batches, block tables with holes, GQA ratios, head dims). They define the
contracts; shapes use T = tokens in the step, R = requests, H = query heads, KVH = kv heads,
D = head dim, B = cache blocks, S = block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64: block_id * S + offset
) -> None:
    """Store each token's key and value at its slot, in place. A negative slot is skipped
    (padding rows of a captured graph)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(kv_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D], this step's keys/values already written
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32: context length after this step
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each request's query rows over its whole context in the paged cache.

    Request r owns query rows [query_start_loc[r], query_start_loc[r + 1]); they are the last
    tokens of its context, so query i of a request with q queries and s context tokens sees
    context positions 0 .. s - q + i. Query heads share kv heads in groups of H // KVH (GQA).
    Computed in float32, returned in the query's dtype.
    """
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[r] : starts[r + 1]].float()  # [Q, H, D]
        num_queries = q.shape[0]
        if num_queries == 0:
            continue
        blocks = block_table[r, : -(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()  # [s, KVH, D]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [s, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, Q, s]
        query_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        scores.masked_fill_(key_pos > query_pos, float("-inf"))
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


def varlen_attention(
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, H, D]
    value: torch.Tensor,  # [N, H, D]
    cu_seqlens: list[int],  # segment s is rows [cu_seqlens[s], cu_seqlens[s + 1])
    scale: float,
) -> torch.Tensor:  # [N, H, D]
    """Bidirectional attention within each segment (the vision tower's images or windows)."""
    out = torch.empty_like(query)
    for start, end in pairwise(cu_seqlens):
        if end > start:
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, L, D]
            out[start:end] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] → weight * normalised x; the norm is taken in float32, the result cast
    back to x's dtype before the weight multiplies it (as transformers' RMSNorm computes it)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum in x's dtype, as the unfused model adds."""
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [T, 2 * d] gate/up projection → [T, d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def mrope(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [3, T] int64 (temporal, height, width ids)
    cos_cache: torch.Tensor,  # [max_positions, D / 2] float32
    sin_cache: torch.Tensor,  # [max_positions, D / 2] float32
    row_of_channel: torch.Tensor,  # [D / 2] int64: which position row drives each frequency
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (rotate-half / NeoX layout) with each frequency channel driven by one of
    three position rows: M-RoPE's consecutive sections or its interleaved channels are just a
    choice of `row_of_channel`; all zeros is plain 1-D RoPE. cos/sin are cast to the inputs'
    dtype before they multiply, as transformers does. Returns new tensors."""
    channels = torch.arange(row_of_channel.shape[0], device=positions.device)
    pos = positions[row_of_channel, :].T  # [T, D / 2]
    cos = cos_cache[pos, channels]
    sin = sin_cache[pos, channels]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return x * c + rotate_half(x) * s

    return rotate(query), rotate(key)


def vision_rotary(
    x: torch.Tensor,  # [N, H, D]
    cos: torch.Tensor,  # [N, D / 2] float32: each row's angles (a vision tower's 2-D RoPE)
    sin: torch.Tensor,  # [N, D / 2] float32
) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) with per-row angles, computed in float32 and cast
    back once, as transformers' vision towers do. Returns a new tensor."""
    c = torch.cat((cos, cos), dim=-1)[:, None, :]  # [N, 1, D]
    s = torch.cat((sin, sin), dim=-1)[:, None, :]
    xf = x.float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x · σ(1.702 · x) (CLIP's GELU approximation, some vision towers' MLP activation)."""
    return x * torch.sigmoid(1.702 * x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] → x Wᵀ + b: [M, N] in x's dtype, accumulated in
    float32 and rounded once (what a bfloat16 GEMM with float32 accumulation returns)."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # [M, N]
    return out.to(x.dtype)


def decoder_layer(
    x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embeddings when residual is None)
    residual: torch.Tensor | None,  # [T, hidden]: the stream before x
    positions: torch.Tensor,  # [3, T] int64
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]: this step's keys and values are written into it
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    slot_mapping: torch.Tensor,  # [T] int64
    weights: Sequence[torch.Tensor],  # input norm, qkv, o, post-attention norm, gate_up, down
    qkv_bias: torch.Tensor | None,  # [(H + 2 KVH) D]
    qk_norms: Sequence[torch.Tensor],  # none, or per-head q and k norms [D]
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    row_of_channel: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the stream before it)
    """A pre-norm decoder layer of the Llama line, x + attn(norm(x)) then + mlp(norm(·)), with each
    residual add folded into the norm after it. Linear weights are plain [out, in]: qkv
    [(H + 2 KVH) D, hidden], o [hidden, H D], gate_up [2 I, hidden], down [hidden, I]."""
    input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight = weights
    num_tokens, head_dim = x.shape[0], kv_cache.shape[4]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if residual is None:
        residual, normed = x, rms_norm(x, input_norm, eps)
    else:
        normed, residual = fused_add_rms_norm(x, residual, input_norm, eps)
    q, k, v = linear(normed, qkv_weight, qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if qk_norms:
        q = rms_norm(q.reshape(-1, head_dim), qk_norms[0], eps).view(q.shape)
        k = rms_norm(k.reshape(-1, head_dim), qk_norms[1], eps).view(k.shape)
    q, k = mrope(q, k, positions, cos_cache, sin_cache, row_of_channel)
    write_kv(k, v, kv_cache, slot_mapping)
    attention = paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale)
    h = linear(attention.reshape(num_tokens, q_size), o_weight)
    h, residual = fused_add_rms_norm(h, residual, post_norm, eps)
    return linear(silu_and_mul(linear(h, gate_up_weight)), down_weight), residual

"""Typed wrappers over the C++ CPU kernels (`csrc/`, built on first use by `_extension`).

Each function has the contract of the function of the same name in `mmserve.ops.reference`,
except where it says "in place". Inputs are CPU tensors, float32 or bfloat16, whose last
dimension is contiguous (rows may be strided views, e.g. q/k/v slices of a fused projection);
the kernels accumulate in float32. Call `is_available()` first to fall back to torch when the
kernels cannot be built here. The ops are called through their `.default` overloads, which
skips the overload resolution of a plain `torch.ops` call (a few microseconds per call).
"""

from __future__ import annotations

import torch

from mmserve.ops._extension import KernelBuildError, is_available, ops
from mmserve.ops.huge_pages import empty_on_huge_pages

__all__ = [
    "KernelBuildError",
    "amx_tiles",
    "bf16_dot_products",
    "bind_threads",
    "decoder_layer",
    "fused_add_rms_norm",
    "gated_packed_linear",
    "is_available",
    "mrope",
    "pack_weight",
    "packed_linear",
    "paged_attention",
    "prompt_attention_min_queries",
    "quick_gelu",
    "rms_norm",
    "set_amx_tiles",
    "set_min_parallel_work",
    "silu_and_mul",
    "varlen_attention",
    "vision_rotary",
    "write_kv",
]


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D], this step's keys/values already written
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D] in query's dtype; allocated when None
) -> torch.Tensor:
    """Causal attention of every request's query rows (decode rows and prompt chunks mixed) over
    its context, read through the block table. Rows of `out` outside every request are left as
    they were. Block table entries past a request's context are never read."""
    if out is None:
        out = torch.empty_like(query)
    ops().paged_attention.default(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale)
    return out


def prompt_attention_min_queries() -> int:
    """Requests with this many query rows or more in a `paged_attention` call are attended by
    torch's flash kernel over their gathered keys (csrc/prompt_attention.h), the rest by the
    tile engine."""
    return ops().prompt_attention_min_queries.default()


def varlen_attention(
    query: torch.Tensor,  # [N, H, D]
    key: torch.Tensor,  # [N, H, D]
    value: torch.Tensor,  # [N, H, D]
    cu_seqlens: list[int] | torch.Tensor,  # segment s is rows [cu_seqlens[s], cu_seqlens[s + 1])
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Bidirectional attention within each segment, all segments in one call."""
    if out is None:
        out = torch.empty_like(query)
    bounds = (
        cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens, dtype=torch.int64)
    )
    ops().varlen_attention.default(out, query, key, value, bounds, scale)
    return out


def write_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative slots are skipped
) -> None:
    """Stores each token's key and value at its slot (converting to the cache's dtype), in place."""
    ops().write_kv.default(key, value, kv_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] → weight * normed x, in the promoted dtype of x and weight."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))  # [T, hidden]
    ops().rms_norm.default(out, x, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as vLLM's: residual ← x + residual (in x's dtype), then x ← rms_norm(residual).

    Returns (x, residual), the same tensor objects, now holding the reference's
    (rms_norm(x + residual), x + residual). x and residual: [T, hidden], same dtype; weight must
    not promote x's dtype (a float32 weight with bfloat16 x raises)."""
    ops().fused_add_rms_norm.default(x, residual, weight, eps)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [T, 2 * d] gate/up projection → [T, d]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)  # [T, d]
    ops().silu_and_mul.default(out, gate_up)
    return out


def mrope(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [3, T] int64
    cos_cache: torch.Tensor,  # [max_positions, D / 2] float32
    sin_cache: torch.Tensor,  # [max_positions, D / 2] float32
    row_of_channel: torch.Tensor,  # [D / 2] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE in place on query and key; returns them, equal to the reference's new tensors."""
    ops().mrope.default(query, key, positions, cos_cache, sin_cache, row_of_channel)
    return query, key


PANEL_COLUMNS = 16  # output columns per panel of a packed weight (csrc/linear.cpp)


def bf16_dot_products() -> bool:
    """Whether this build multiplies bfloat16 with AVX512-BF16's vdpbf16ps: then bfloat16
    weights are packed in K pairs (csrc/linear.cpp) and bfloat16 `varlen_attention` with an even
    head_dim up to 256 runs on it (csrc/varlen_attention_dot.cpp), or on AMX tiles where
    `amx_tiles` (csrc/varlen_attention_amx.cpp); else a bfloat16 linear widens
    each weight to float32 in registers (AVX2 + FMA) and varlen attention runs on the tile engine."""
    return ops().bf16_dot_products.default()


def amx_tiles() -> bool:
    """Whether bfloat16 linears of 2 rows or more over K-pair panels (K a multiple of 32) run on
    AMX's tdpbf16ps (csrc/linear_amx.h), and bfloat16 `varlen_attention` too
    (csrc/varlen_attention_amx.cpp): an AMX-BF16 build in a process Linux granted the tile
    registers. The same packed weight serves decode on vdpbf16ps."""
    return ops().amx_tiles.default()


def set_amx_tiles(on: bool) -> bool:
    """Turns the AMX kernels off (False) or back on where `amx_tiles` was true, for the whole
    process; returns `amx_tiles()` as it was. Off, an AMX build runs the vdpbf16ps kernels of
    AVX512-BF16 CPUs without AMX (Zen 4), bit for bit those of their own build: the kernel tests
    check both paths in one build. Not a numeric op; the choices made once in mmserve.ops.linear
    and mmserve.ops.kernels do not follow it."""
    return ops().set_amx_tiles.default(on)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight: [N, K] float32 or bfloat16 → panels [ceil(N / 16), K, 16] of `dtype` (float32 or
    bfloat16; the weight's own when None) for `packed_linear`; a float32 weight packed as
    bfloat16 is rounded."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL_COLUMNS)
    # [P, K, 16]; streamed from memory at every decode step, so on huge pages
    packed = empty_on_huge_pages((panels, in_features, PANEL_COLUMNS), dtype or weight.dtype)
    ops().pack_weight.default(packed, weight)
    return packed


def packed_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16, rows may be strided
    packed: torch.Tensor,  # from pack_weight
    bias: torch.Tensor | None,  # [N]
    out_features: int,
) -> torch.Tensor:  # [..., N] in x's dtype
    """`reference.linear` with the weight that was packed: float32 accumulation, one rounding."""
    return ops().packed_linear.default(x, packed, bias, out_features)


def gated_packed_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16, rows may be strided
    packed: torch.Tensor,  # a gate/up weight [2 d, K] (gate rows first) from pack_weight
    bias: torch.Tensor | None,  # [2 d]
    out_features: int,  # 2 d, d a multiple of 16
) -> torch.Tensor:  # [..., d] in x's dtype
    """`reference.silu_and_mul(reference.linear(x, W, b))` over a packed gate/up weight, bit for
    bit `silu_and_mul(packed_linear(...))` on these kernels: the activation of each 16 columns is
    computed by the thread that just produced them (the MLP's SwiGLU inside the linear)."""
    return ops().gated_packed_linear.default(x, packed, bias, out_features)


def decoder_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    weights: list[torch.Tensor],  # input norm, qkv, o, post-attention norm, gate_up, down
    qkv_bias: torch.Tensor | None,
    qk_norms: list[torch.Tensor],
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    row_of_channel: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.decoder_layer` in one call, with its four linear weights packed by
    `pack_weight` or by oneDNN (`linear.OneDnnLinear.packed`, any mix), in place: x and residual
    (x itself when None) are overwritten, and the returned stream is that tensor. The ops of
    csrc/ in the layer modules' order, so results are those of the unfused layer on this kernel
    set, bit for bit."""
    out = ops().decoder_layer.default(
        x, residual, positions, kv_cache, query_start_loc, seq_lens, block_table, slot_mapping, weights,
        qkv_bias, qk_norms, cos_cache, sin_cache, row_of_channel, num_heads, num_kv_heads, eps, scale,
    )  # fmt: skip
    return out, x if residual is None else residual


def vision_rotary(
    x: torch.Tensor,  # [N, H, D]
    cos: torch.Tensor,  # [N, D / 2] float32, contiguous
    sin: torch.Tensor,  # [N, D / 2] float32, contiguous
) -> torch.Tensor:
    """The 2-D rotary embedding in place on x (float32 math, one rounding); returns x."""
    ops().vision_rotary.default(x, cos, sin)
    return x


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x · σ(1.702 · x) into a new tensor of x's shape (x contiguous)."""
    out = torch.empty_like(x)
    ops().quick_gelu.default(out, x)
    return out


def bind_threads(cpus: list[int]) -> None:
    """Run torch's (and these kernels') parallel work on len(cpus) OpenMP threads, thread i pinned
    to CPU cpus[i]; the calling thread is thread 0. Not a numeric op: the reference is the OS's own
    placement, which `mmserve.worker.cpu_threads` keeps when asked not to pin."""
    ops().bind_threads.default(cpus)


def set_min_parallel_work(work: int) -> int:
    """Sets the work (multiply-add equivalents) above which a kernel's region takes a second
    thread; returns the previous value. Below it a region runs on the calling thread: a fork
    and join costs more than it saves, and much more when a thread it waits for has lost its core
    to another process. 0: every region with more than one task is parallel (the kernel tests
    use it to reach the split paths with small shapes). Default 2^20, about 20 µs on one core."""
    return ops().set_min_parallel_work.default(work)

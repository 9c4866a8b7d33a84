"""RMSNorm, and RMSNorm fused with the residual add that precedes it (residual updated in place)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.launch import Launch, next_power_of_two


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, hidden]
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden], updated to x + residual (ADD_RESIDUAL only)
    weight_ptr,  # [hidden]
    x_stride,
    residual_stride,
    out_stride,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """Program t normalises row t in one block of BLOCK ≥ hidden columns."""
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    x = tl.load(x_ptr + row * x_stride + columns, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual_ptrs = residual_ptr + row * residual_stride + columns
        # The sum in the input dtype, as the unfused model adds: round before normalising.
        total = (x + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inverse_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast before the weight
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + columns, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def plan_rms_norm(
    out: torch.Tensor,  # [T, hidden]
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> Launch:
    rows = [t for t in (out, x, residual) if t is not None]
    if any(t.dim() != 2 or t.stride(-1) != 1 for t in rows) or weight.stride(-1) != 1:
        raise ValueError("rms_norm takes [T, hidden] rows with contiguous columns")
    num_rows, hidden = x.shape
    block = next_power_of_two(hidden)
    args = dict(
        out_ptr=out,
        x_ptr=x,
        residual_ptr=x if residual is None else residual,
        weight_ptr=weight,
        x_stride=x.stride(0),
        residual_stride=0 if residual is None else residual.stride(0),
        out_stride=out.stride(0),
        hidden=hidden,
        eps=eps,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
    )
    return Launch(_rms_norm_kernel, (num_rows,), args, num_warps=_num_warps(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm`: x [T, hidden] → weight * normalised x, normalised in float32 and cast
    to x's dtype before the weight multiplies; the result has torch's promoted dtype."""
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    plan_rms_norm(out, x, None, weight, eps).run()
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fused_add_rms_norm` with the sum written into `residual` in place:
    → (rms_norm(x + residual), residual), the sum rounded to the shared dtype of x and residual."""
    if x.dtype != residual.dtype or x.shape != residual.shape:
        raise ValueError("x and residual need one shape and one dtype (the sum is stored in residual)")
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    plan_rms_norm(out, x, residual, weight, eps).run()
    return out, residual

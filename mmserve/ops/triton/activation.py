"""SiLU-and-mul (SwiGLU) over a fused gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.ops.triton.launch import Launch

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, d]
    gate_up_ptr,  # [T, 2 * d]: gate columns, then up columns
    gate_up_stride,
    out_stride,
    width,  # d
    BLOCK: tl.constexpr,
):
    """Program (t, c) computes columns [c * BLOCK, (c + 1) * BLOCK) of row t."""
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    gate_ptrs = gate_up_ptr + row * gate_up_stride + columns
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    element = out_ptr.dtype.element_ty
    # Rounded after the SiLU and after the product, as the two torch ops in the reference round.
    silu = (gate / (1.0 + tl.exp(-gate))).to(element).to(tl.float32)
    tl.store(out_ptr + row * out_stride + columns, (silu * up).to(element), mask=mask)


def plan_silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> Launch:
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError("silu_and_mul takes [T, 2 * d] rows with contiguous columns")
    num_rows, width = out.shape
    args = dict(
        out_ptr=out,
        gate_up_ptr=gate_up,
        gate_up_stride=gate_up.stride(0),
        out_stride=out.stride(0),
        width=width,
        BLOCK=BLOCK,
    )
    return Launch(_silu_and_mul_kernel, (num_rows, -(-width // BLOCK)), args, num_warps=4)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul`: a fused [T, 2 * d] gate/up projection → silu(gate) * up, [T, d]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    plan_silu_and_mul(out, gate_up).run()
    return out

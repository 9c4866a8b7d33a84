"""Triton RMSNorm, fused add + RMSNorm and SiLU-and-mul against their references.

The kernels round where the reference's torch ops round, so half-precision results agree to
one unit in the last place (float32 reductions in a different order), float32 to rounding.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import reference

pytest.importorskip("triton")
from mmserve.ops.triton.activation import silu_and_mul
from mmserve.ops.triton.norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two units in the last place of the dtype (one rounding each side may differ)."""
    eps = 1e-6 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, rtol=2 * eps, atol=eps)


def random(shape, dtype, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype, device):
    x = random((5, 96), dtype, device, 0) * 3  # a hidden size that is not a power of two
    weight = random((96,), dtype, device, 1)
    got = rms_norm(x, weight, 1e-6)
    close(got, reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_residual_in_place(dtype, device):
    x = random((5, 96), dtype, device, 2)
    residual = random((5, 96), dtype, device, 3)
    weight = random((96,), dtype, device, 4)
    expected_out, expected_sum = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    out, total = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert total is residual
    assert torch.equal(residual, expected_sum)  # the sum rounds once, to the same value
    close(out, expected_out)


def test_rms_norm_with_float32_weight_returns_float32(device):
    x = random((3, 64), torch.bfloat16, device, 5)
    weight = random((64,), torch.float32, device, 6)
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, device):
    gate_up = random((3, 2 * 1500), dtype, device, 7) * 4  # two column blocks, the second partial
    got = silu_and_mul(gate_up)
    close(got, reference.silu_and_mul(gate_up))

"""The C++ vision-tower elementwise kernels (2-D rotary in place, quick_gelu) against their
torch references."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import cpu, reference

FP32_TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
BF16_TOLERANCE = {"rtol": 2**-7, "atol": 2**-12}  # one bfloat16 ulp apart at most


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "heads", "head_dim"), [(1, 1, 32), (257, 10, 64), (100, 16, 80), (33, 3, 44)]
)
def test_vision_rotary_in_place_matches_the_reference(rows, heads, head_dim, dtype):
    generator = torch.Generator().manual_seed(rows * heads + head_dim)
    # q and k as strided views of one fused [N, 3, H, D] projection, as the tower makes them
    qkv = torch.randn(rows, 3, heads, head_dim, generator=generator).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 100  # positions × frequencies
    cos, sin = angles.cos(), angles.sin()
    q, k, v = qkv.unbind(1)
    want_q, want_k = reference.vision_rotary(q, cos, sin), reference.vision_rotary(k, cos, sin)
    v_before = v.clone()
    got_q = cpu.vision_rotary(q, cos, sin)
    cpu.vision_rotary(k, cos, sin)
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    assert got_q.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(q, want_q, **tolerance)
    torch.testing.assert_close(k, want_k, **tolerance)
    assert torch.equal(v, v_before)  # the rows between q's and k's are not touched


def test_vision_rotary_refuses_tables_of_the_wrong_shape():
    x = torch.randn(4, 2, 32)
    with pytest.raises(RuntimeError, match=r"cos and sin must be contiguous float32 \[N, D / 2\]"):
        cpu.vision_rotary(x, torch.zeros(4, 32), torch.zeros(4, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7,), (4096, 2560), (3, 1001)])
def test_quick_gelu_matches_the_reference(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=generator) * 4).to(dtype)  # well into both tails
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(cpu.quick_gelu(x), reference.quick_gelu(x), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quick_gelu_saturates_in_both_tails_and_keeps_nan(dtype):
    # past |1.702 x| ≈ 87 the kernel's σ is clamped to 1 or 2^-126: x · σ stays finite and 0 or x
    tails = [-1e4, -200.0, -60.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 60.0, 200.0, 1e4]
    x = torch.tensor(tails * 2 + [float("nan")] * 10, dtype=dtype)  # 32: vector lanes and the tail
    got, want = cpu.quick_gelu(x), reference.quick_gelu(x)
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    torch.testing.assert_close(got, want, equal_nan=True, **tolerance)
    assert got[-10:].isnan().all()

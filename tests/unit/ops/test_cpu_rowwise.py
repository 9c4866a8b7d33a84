"""The C++ row-wise kernels (write_kv, RMSNorm, fused add + RMSNorm, SiLU-and-mul, M-RoPE)
against mmserve.ops.reference, over widths with and without vector tails, strided rows and
both dtypes; the in-place kernels' results must equal the reference's new tensors."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import cpu, reference

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [1, 7, 64, 100, 1536]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """float32: 1e-5. bfloat16: two ulps of the result, as these ops round twice (an intermediate
    such as `normed.to(x.dtype)`, then the result): float32 sums in a different order can put
    the intermediate one ulp away, and the final rounding can add another."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 1e-5}


def strided(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, width] with a row stride of width + 3: a view, as slices of fused projections are."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width + 3, generator=generator).to(dtype)[:, :width]


@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_write_kv_stores_every_slot_and_skips_negative_ones(key_dtype, cache_dtype):
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(9, 6, 24, generator=generator).to(key_dtype)  # [T, 2 * KVH + 2, D]
    key, value = fused[:, :2], fused[:, 2:4]
    slots = torch.tensor([5, -1, 0, 63, 17, -3, 40, 41, 8])
    got = torch.randn(2, 8, 8, 2, 24, generator=generator).to(cache_dtype)
    want = got.clone()
    cpu.write_kv(key, value, got, slots)
    reference.write_kv(key, value, want, slots)
    assert torch.equal(got, want)


def test_write_kv_rejects_a_slot_past_the_cache():
    cache = torch.zeros(2, 4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.write_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([16]))


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_reference(width, dtype, weight_dtype):
    x = strided(5, width, dtype, seed=width)
    weight = torch.randn(width).to(weight_dtype)
    got = cpu.rms_norm(x, weight, 1e-6)
    want = reference.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, **tolerance(want.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_add_rms_norm_updates_both_in_place(width, dtype):
    x = strided(6, width, dtype, seed=width)
    residual = strided(6, width, dtype, seed=width + 1)
    weight = torch.randn(width).to(dtype)
    want_normed, want_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    normed, total = cpu.fused_add_rms_norm(x_in, residual_in, weight, 1e-6)
    assert normed is x_in and total is residual_in
    torch.testing.assert_close(total, want_sum, rtol=0, atol=0)  # the same rounded add
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))


def test_fused_add_rms_norm_rejects_a_promoting_weight():
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="must not promote"):
        cpu.fused_add_rms_norm(x, x.clone(), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_and_mul_matches_reference(width, dtype):
    gate_up = strided(4, 2 * width, dtype, seed=width) * 4
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tolerance(dtype))


def row_choices(half: int) -> dict[str, torch.Tensor]:
    """Qwen2-VL's sections (t, h, w thirds), an interleaving (Qwen3-VL style) and plain RoPE."""
    third = half // 3
    sections = torch.cat([torch.full((n,), i) for i, n in enumerate((half - 2 * third, third, third))])
    return {
        "sections": sections,
        "interleaved": torch.arange(half) % 3,
        "plain": torch.zeros(half, dtype=torch.long),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [36, 64, 80, 128])
@pytest.mark.parametrize("layout", ["sections", "interleaved", "plain"])
def test_mrope_in_place_equals_reference(layout, head_dim, dtype):
    half = head_dim // 2
    generator = torch.Generator().manual_seed(head_dim)
    max_positions = 512
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * torch.rand(half, generator=generator)
    cos_cache, sin_cache = freqs.cos(), freqs.sin()  # [max_positions, D / 2]
    positions = torch.randint(0, max_positions, (3, 11), generator=generator)
    fused = torch.randn(11, 7, head_dim, generator=generator).to(dtype)  # [T, H + KVH + KVH, D]
    query, key = fused[:, :4], fused[:, 4:6]
    value = fused[:, 6:].clone()
    want_q, want_k = reference.mrope(query, key, positions, cos_cache, sin_cache, row_choices(half)[layout])
    got_q, got_k = cpu.mrope(query, key, positions, cos_cache, sin_cache, row_choices(half)[layout])
    assert got_q is query and got_k is key
    torch.testing.assert_close(got_q, want_q, **tolerance(dtype))
    torch.testing.assert_close(got_k, want_k, **tolerance(dtype))
    assert torch.equal(fused[:, 6:], value)  # rows of the views only: the rest of the buffer is untouched


def test_mrope_rejects_a_position_past_the_cache():
    cache = torch.zeros(8, 16)
    q, k = torch.zeros(2, 1, 32), torch.zeros(2, 1, 32)
    positions = torch.tensor([[0, 8], [0, 0], [0, 0]])
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        cpu.mrope(q, k, positions, cache, cache, torch.zeros(16, dtype=torch.long))

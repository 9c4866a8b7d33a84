"""The C++ varlen (vision tower) attention kernel against the reference and the current torch path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmserve.ops import cpu, reference
from mmserve.ops.sdpa import varlen_attention_sdpa as torch_varlen_attention

pytestmark = pytest.mark.usefixtures("parallel_threshold")

FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def assert_within_bfloat16_resolution(got, q, k, v, bounds, scale):
    """bfloat16 attention within 2^-7 of the float32 result, relative to the magnitude of its
    terms, Σ_j p_j |v_j| (a plain rtol misstates outputs near zero): the probabilities may be
    rounded to bfloat16 for P · V (torch's flash kernel and the vdpbf16ps path do), and the
    output is rounded once."""
    q, k, v = q.float(), k.float(), v.float()
    want = reference.varlen_attention(q, k, v, bounds, scale)
    magnitude = reference.varlen_attention(q, k, v.abs(), bounds, scale)
    assert got.dtype == torch.bfloat16
    excess = (got.float() - want).abs() - 2**-7 * magnitude
    assert (excess <= 1e-6).all(), f"worst excess {excess.max().item():.3g}"


def random_bounds(rng: np.random.Generator, max_length: int) -> list[int]:
    """cu_seqlens of 1–6 segments, some empty, some longer than a query tile or a key split."""
    lengths = rng.integers(0, max_length + 1, size=int(rng.integers(1, 7)))
    return [0, *np.cumsum(lengths).tolist()]


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "head_dim"), [(1, 32), (4, 64), (16, 80), (2, 128), (3, 44)])
def test_random_segments_match_reference(num_heads, head_dim, dtype):
    rng = np.random.default_rng([num_heads, head_dim])
    generator = torch.Generator().manual_seed(num_heads * head_dim)
    for _ in range(3):
        bounds = random_bounds(rng, 300)
        # q, k, v as views into one fused [N, 3, H, D] projection, as the vision tower makes them
        qkv = torch.randn(bounds[-1], 3, num_heads, head_dim, generator=generator).to(dtype)
        q, k, v = qkv.unbind(1)
        got = cpu.varlen_attention(q, k, v, bounds, head_dim**-0.5)
        if dtype == torch.bfloat16:
            assert_within_bfloat16_resolution(got, q, k, v, bounds, head_dim**-0.5)
            continue
        torch.testing.assert_close(
            got, reference.varlen_attention(q, k, v, bounds, head_dim**-0.5), **FP32_TOLERANCE
        )


def test_same_length_windows_match_the_torch_path():
    """Qwen2.5-VL windows: many equal segments plus a ragged last one."""
    bounds = [0, *range(64, 64 * 12 + 1, 64), 64 * 12 + 37]
    q, k, v = (torch.randn(bounds[-1], 16, 80) for _ in range(3))
    got = cpu.varlen_attention(q, k, v, torch.tensor(bounds), 80**-0.5)
    torch.testing.assert_close(got, torch_varlen_attention(q, k, v, bounds, 80**-0.5), **FP32_TOLERANCE)


def test_segments_past_the_rows_are_rejected():
    q = torch.randn(10, 2, 32)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cpu.varlen_attention(q, q, q, [0, 5, 11], 1.0)


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize(("num_heads", "head_dim"), [(1, 2), (4, 16), (2, 72), (1, 256), (2, 3)])
def test_bfloat16_segments_across_key_blocks_match_reference(num_heads, head_dim):
    """Segments at and around the 64-key blocks of the vdpbf16ps path (AVX512-BF16 builds; the
    tile engine elsewhere), head dims from one pair to 256, an odd one (never the dot path), a
    tower-sized 1,024-patch image."""
    generator = torch.Generator().manual_seed(head_dim)
    bounds = [0, 1, 64, 127, 192, 257, 1281]  # lengths 1, 63, 63, 65, 65, 1024
    qkv = torch.randn(bounds[-1], 3, num_heads, head_dim, generator=generator).bfloat16()
    q, k, v = qkv.unbind(1)
    got = cpu.varlen_attention(q, k, v, bounds, head_dim**-0.5)
    assert_within_bfloat16_resolution(got, q, k, v, bounds, head_dim**-0.5)


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize("sharpness", [4.0, 30.0])
def test_bfloat16_sharp_attention_matches_reference(sharpness):
    """Scores spread over hundreds: most probabilities underflow to 0 (the dot path's 2^x flushes
    below 2^-126), and a row's max keeps rising across key blocks (keys sorted by their score)."""
    generator = torch.Generator().manual_seed(int(sharpness))
    bounds = [0, 300, 1000]
    q, k, v = (torch.randn(bounds[-1], 2, 64, generator=generator) for _ in range(3))
    q = q * sharpness
    k = k[k[:, :, 0].argsort(dim=0)[:, 0]]  # rising q·k along the keys for rows with q[0] > 0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = cpu.varlen_attention(q, k, v, bounds, 64**-0.5)
    assert_within_bfloat16_resolution(got, q, k, v, bounds, 64**-0.5)


def test_bfloat16_probabilities_round_as_exact_ones_on_vdpbf16ps():
    """The vdpbf16ps kernel (AVX512-BF16 without AMX: Zen 4; tiles off in an AMX build) rounds
    each probability to bfloat16 for P · V from a 2^x near enough the exact one that at most 1e-4
    of them round otherwise (torch's exp: ~1e-5). A degree-4 2^x (relative error 2.7e-6) rounds
    6e-4 of these otherwise, which moved a Zen 4's bfloat16 qwen3_vl logits 3 rounding steps from
    transformers'. (The AMX kernel's degree-4 2^x is not held to this: a fifth degree costs it
    6-8 %.)

    Built so that each output is one rounded probability: key 0 scores 0 for every query and the
    others x = -50 + a·c exactly (a, c bfloat16 in [1, 2); scale · log2 e is 1 in float32), so
    the max never moves and the float32 normaliser is exactly 1 (the rest sum under 2^-38); the
    value of key j is the unit vector j."""
    if not cpu.bf16_dot_products():
        pytest.skip("no vdpbf16ps kernel in this build")
    heads, dim = 2, 256  # dim queries, keys and value columns
    generator = torch.Generator().manual_seed(0)
    a, c = ((1 + torch.rand(dim, heads, generator=generator)).bfloat16().float() for _ in range(2))
    q, k, v = (torch.zeros(dim, heads, dim) for _ in range(3))
    q[:, :, 0], q[:, :, 1] = 1, a
    k[1:, :, 0], k[1:, :, 1] = -50, c[1:]
    v[1:] = torch.eye(dim)[1:, None, :]
    scale = float(torch.tensor(math.log(2), dtype=torch.float32))
    tiles = cpu.set_amx_tiles(False)
    try:
        got = cpu.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), [0, dim], scale)
    finally:
        cpu.set_amx_tiles(tiles)
    x = a.double()[:, None, :] * c.double()[None, :, :] - 50  # [query, key, head]
    want = torch.exp2(x[:, 1:]).bfloat16()
    differs = (got.transpose(1, 2)[:, 1:] != want).double().mean().item()
    assert differs <= 1e-4, f"{differs:.2e} of the probabilities rounded otherwise"


@pytest.mark.usefixtures("amx_tiles")
@pytest.mark.parametrize(("num_heads", "head_dim"), [(2, 16), (3, 64), (1, 80), (2, 96), (1, 128)])
def test_bfloat16_segments_across_row_and_key_blocks_match_reference(num_heads, head_dim):
    """Segment lengths at and around the AMX path's blocks (AMX builds; the vdpbf16ps path on
    other AVX512-BF16 CPUs): 16-row tiles and 32-row blocks of queries, 128-key blocks with a
    64-key block at the end, the next block's scores made during the softmax; head dims that
    fill whole 32-wide tiles and ones padded to them."""
    generator = torch.Generator().manual_seed(head_dim + num_heads)
    lengths = [16, 17, 31, 32, 33, 127, 128, 129, 191, 192, 193, 320]
    bounds = [0, *np.cumsum(lengths).tolist()]
    qkv = torch.randn(bounds[-1], 3, num_heads, head_dim, generator=generator).bfloat16()
    q, k, v = qkv.unbind(1)
    got = cpu.varlen_attention(q, k, v, bounds, head_dim**-0.5)
    assert_within_bfloat16_resolution(got, q, k, v, bounds, head_dim**-0.5)


def test_cpu_vision_attention_sends_bfloat16_images_to_the_kernel_where_it_leads():
    """mmserve.worker.kernel_plan: a bfloat16 image goes to csrc's kernel where it runs on
    vdpbf16ps without AMX or on AMX tiles, to torch's flash kernel elsewhere (the two round
    differently, so the output tells which ran)."""
    from mmserve.worker.kernel_plan import bf16_dot_products_lead, cpu_vision_attention

    generator = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(600, 3, 2, 64, generator=generator).bfloat16().unbind(1)
    got = cpu_vision_attention()(q, k, v, [0, 600], 64**-0.5)
    kernel = cpu.varlen_attention(q, k, v, [0, 600], 64**-0.5)
    flash = torch_varlen_attention(q, k, v, [0, 600], 64**-0.5)
    assert not torch.equal(kernel, flash)
    leads = bf16_dot_products_lead() or cpu.amx_tiles()
    assert torch.equal(got, kernel if leads else flash)

"""The vision tower's packed-segment Triton attention against `reference.varlen_attention`."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import reference

pytest.importorskip("triton")
from mmserve.ops.triton.vision_attention import BLOCK_M, varlen_attention

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# An empty segment, a single patch, one longer than a row block, and two ordinary ones.
SEGMENT_LENGTHS = [0, 1, BLOCK_M + 6, 5, 17]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def packed_segments(dtype: torch.dtype, device: torch.device, heads: int, head_dim: int):
    generator = torch.Generator().manual_seed(len(SEGMENT_LENGTHS) + head_dim)
    cu_seqlens = torch.tensor(SEGMENT_LENGTHS).cumsum(0).tolist()
    cu_seqlens = [0, *cu_seqlens]
    qkv = torch.randn(cu_seqlens[-1], 3, heads, head_dim, generator=generator).to(device, dtype)
    return qkv.unbind(1), cu_seqlens  # query, key, value: strided views of one fused projection


@pytest.mark.parametrize("head_dim", [64, 80])
def test_segments_match_reference(head_dim, device):
    (query, key, value), cu_seqlens = packed_segments(torch.float32, device, heads=2, head_dim=head_dim)
    scale = head_dim**-0.5
    got = varlen_attention(query, key, value, cu_seqlens, scale)
    expected = reference.varlen_attention(query, key, value, cu_seqlens, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_cu_seqlens_tensor_and_list_agree(device):
    (query, key, value), cu_seqlens = packed_segments(torch.float32, device, heads=1, head_dim=64)
    as_tensor = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    torch.testing.assert_close(
        varlen_attention(query, key, value, as_tensor, 0.125),
        varlen_attention(query, key, value, cu_seqlens, 0.125),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(dtype, device):
    (query, key, value), cu_seqlens = packed_segments(dtype, device, heads=2, head_dim=80)
    got = varlen_attention(query, key, value, cu_seqlens, 80**-0.5)
    expected = reference.varlen_attention(query.float(), key.float(), value.float(), cu_seqlens, 80**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_attends_only_the_segments_given(device):
    (query, key, value), cu_seqlens = packed_segments(torch.float32, device, heads=1, head_dim=64)
    for bounds in ([0], cu_seqlens[:3]):  # no segments at all; the first two segments only
        got = varlen_attention(query, key, value, bounds, 0.125)
        expected = reference.varlen_attention(query, key, value, bounds, 0.125)
        torch.testing.assert_close(got[: bounds[-1]], expected[: bounds[-1]], rtol=1e-5, atol=1e-5)

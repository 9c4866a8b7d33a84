"""The torch kernel set's varlen attention (equal segments stacked into one SDPA call) against
the reference that attends segment by segment."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import reference
from mmserve.ops.sdpa import varlen_attention_sdpa


@pytest.mark.parametrize(
    "lengths",
    [
        [4096 // 16],  # one image: the whole tensor, a view
        [64] * 6,  # back-to-back windows: a view
        [64] * 5 + [37],  # windows and a ragged last one
        [5, 7, 5, 0, 7, 5],  # equal lengths apart: gathered
        [3, 0, 3, 3, 9],  # an empty segment inside a run
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_segments_match_one_call_per_segment(lengths: list[int], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(len(lengths))
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    # q, k, v as strided views into one fused [N, 3, H, D] projection, as the vision tower makes them
    qkv = torch.randn(bounds[-1], 3, 4, 32, generator=generator).to(dtype)
    q, k, v = qkv.unbind(1)
    got = varlen_attention_sdpa(q, k, v, bounds, 32**-0.5)
    want = reference.varlen_attention(q, k, v, bounds, 32**-0.5)
    # bf16: its resolution at the outputs' magnitude (|out| < 1: a weighted mean of unit normals)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-8}
    torch.testing.assert_close(got, want, **tolerance)

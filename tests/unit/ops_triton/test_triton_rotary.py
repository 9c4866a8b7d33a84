"""The in-place Triton M-RoPE against `reference.mrope`."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import reference

pytest.importorskip("triton")
from mmserve.ops.triton.rotary import mrope

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two units in the last place of the dtype (one rounding each side may differ)."""
    eps = 1e-6 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, rtol=2 * eps, atol=eps)


def rope_caches(max_positions: int, head_dim: int, device: torch.device):
    inverse_frequency = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_positions).float()[:, None] * inverse_frequency  # [P, D / 2]
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "sections"),
    [(128, (16, 24, 24)), (80, (40, 0, 0))],  # Qwen2-VL's M-RoPE sections; plain 1-D RoPE
)
def test_rotates_query_and_key_in_place_like_reference(dtype, head_dim, sections, device):
    """q and k are views of one fused qkv (GQA: fewer kv heads); v next to them stays untouched."""
    num_tokens, heads, kv_heads, max_positions = 7, 6, 2, 50
    generator = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=generator).to(device, dtype)
    query, key, value = qkv.split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.randint(0, max_positions, (3, num_tokens), generator=generator).to(device)
    row_of_channel = torch.repeat_interleave(torch.arange(3), torch.tensor(sections)).to(device)
    cos, sin = rope_caches(max_positions, head_dim, device)
    expected_query, expected_key = reference.mrope(query, key, positions, cos, sin, row_of_channel)
    value_before = value.clone()
    got_query, got_key = mrope(query, key, positions, cos, sin, row_of_channel)
    assert got_query is query and got_key is key
    close(query, expected_query)
    close(key, expected_key)
    assert torch.equal(value, value_before)

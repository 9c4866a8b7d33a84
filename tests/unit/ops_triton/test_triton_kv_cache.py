"""The Triton KV write against `reference.write_kv`."""

from __future__ import annotations

import pytest
import torch

from mmserve.ops import reference

pytest.importorskip("triton")
from mmserve.ops.triton.kv_cache import write_kv

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.mark.parametrize(
    ("key_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_writes_each_token_at_its_slot_and_skips_negative_slots(key_dtype, cache_dtype, device):
    """Scattered slots across blocks, padding rows with slot -1, keys/values as views of a fused qkv."""
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 80
    qkv = torch.randn(9, 4 + 2 * kv_heads, head_dim, generator=generator).to(device, key_dtype)
    key, value = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]  # [T, KVH, D], strided
    slots = torch.tensor([17, 3, -1, 95, 40, 41, -1, 0, 64], device=device)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), device=device)
    cache = cache.to(cache_dtype)
    expected = cache.clone()
    reference.write_kv(key, value, expected, slots)
    write_kv(key, value, cache, slots)
    assert torch.equal(cache.isnan(), expected.isnan())  # nothing written but the slots
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)

"""M-RoPE positions and Qwen2.5-VL windows against transformers' own index functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.vision_utils import get_vision_window_index

from mmserve.layers.rotary import MRotaryEmbedding, inverse_frequencies
from mmserve.models.qwen2_5_vl.model import window_partition
from mmserve.models.qwen2_vl.positions import mrope_input_positions

IMAGE = 7
MERGE = 2


def hf_rope_index(token_ids: list[int], grids: list[tuple[int, int, int]]):
    model = Qwen2VLModel.__new__(Qwen2VLModel)  # get_rope_index needs only the config
    model.config = Qwen2VLConfig(vision_config={"spatial_merge_size": MERGE})
    ids = torch.tensor([token_ids])
    positions, delta = model.get_rope_index(ids, (ids == IMAGE).int(), torch.tensor(grids))
    return positions[:, 0].numpy(), int(delta[0, 0])


def layout(pieces: list[int | tuple[int, int]]) -> tuple[list[int], list]:
    """pieces: text lengths (ints) and image grids (h, w) → token ids and our image list."""
    ids, images = [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += [1] * piece
        else:
            h, w = piece
            n = h * w // MERGE**2
            images.append((len(ids), n, (1, h, w)))
            ids += [IMAGE] * n
    return ids, images


@pytest.mark.parametrize(
    "pieces",
    [
        [5, (4, 6), 3],
        [(8, 4), 10],
        [3, (6, 6)],
        [2, (4, 4), 1, (2, 10), 4],
        [(2, 2), 1, (4, 8)],
    ],
)
def test_mrope_positions_match_transformers(pieces):
    ids, images = layout(pieces)
    want, want_delta = hf_rope_index(ids, [g for _, _, g in images])
    got, delta = mrope_input_positions(len(ids), images, MERGE)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta


def test_text_only_positions_are_the_token_index():
    positions, delta = mrope_input_positions(6, [], MERGE)
    np.testing.assert_array_equal(positions, np.tile(np.arange(6), (3, 1)))
    assert delta == 0


def test_cached_rotation_equals_direct_computation():
    rope = MRotaryEmbedding(head_dim=32, theta=1e6, mrope_section=(4, 6, 6), max_positions=512)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (3, 50), generator=generator)
    q, k = torch.randn(50, 4, 32, generator=generator), torch.randn(50, 2, 32, generator=generator)
    got_q, got_k = rope(positions, q.clone(), k.clone())
    inv = inverse_frequencies(32, 1e6)  # the same frequencies: what is checked is the cache
    freqs = positions[..., None].float() * inv  # [3, T, 16]
    sections = torch.cat([f[i % 3] for i, f in enumerate(freqs.split([4, 6, 6], dim=-1))], dim=-1)
    angles = torch.cat([sections, sections], -1)[:, None, :]  # [T, 1, 32]
    rotate_half = lambda x: torch.cat((-x[..., 16:], x[..., :16]), dim=-1)
    # Within float32 rounding: cos over a table and over a gathered tensor may take different
    # vectorised paths, which can differ in the last bit.
    for got, x in ((got_q, q), (got_k, k)):
        want = x * angles.cos() + rotate_half(x) * angles.sin()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("grids", [[(1, 16, 16)], [(1, 10, 22), (1, 8, 8)], [(1, 4, 30), (1, 32, 6)]])
def test_window_partition_matches_transformers(grids):
    order, cu = window_partition(grids, spatial_merge_size=2, window_tokens=4)
    want_order, want_cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=112, patch_size=14
    )
    np.testing.assert_array_equal(order, want_order.numpy())
    assert cu == want_cu.tolist()

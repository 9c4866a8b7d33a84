"""Video M-RoPE positions (Qwen2-VL, Qwen2.5-VL's time-aligned ones) and Qwen3-VL's interleaved
rotary channels, against transformers' own functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from mmserve.layers.rotary import InterleavedMRotaryEmbedding
from mmserve.models.qwen2_vl.positions import mrope_input_positions
from mmserve.models.qwen2_vl.processing import position_step

IMAGE, VIDEO, MERGE = 7, 8, 2


def layout(pieces):
    """Text lengths, ("image", h, w) and ("video", t, h, w, seconds_per_patch) → ids, items, intervals."""
    ids, items, videos = [], [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += [1] * piece
            continue
        kind, *grid = piece
        t, h, w = (1, *grid) if kind == "image" else grid[:3]
        n = t * h * w // MERGE**2
        items.append((len(ids), n, (t, h, w)))
        videos.append(None if kind == "image" else grid[3])
        ids += [IMAGE if kind == "image" else VIDEO] * n
    return ids, items, videos


def hf_positions(model_class, config, ids, items, videos):
    model = model_class.__new__(model_class)  # get_rope_index needs only the config
    model.config = config
    tensor = torch.tensor([ids])
    token_types = (tensor == IMAGE).int() + 2 * (tensor == VIDEO).int()
    images = [g for (_, _, g), v in zip(items, videos) if v is None]
    clips = [g for (_, _, g), v in zip(items, videos) if v is not None]
    kwargs = {"image_grid_thw": torch.tensor(images) if images else None}
    kwargs["video_grid_thw"] = torch.tensor(clips) if clips else None
    if model_class is Qwen2_5_VLModel and clips:
        kwargs["second_per_grid_ts"] = torch.tensor([v for v in videos if v is not None])
    positions, delta = model.get_rope_index(tensor, token_types, **kwargs)
    return positions[:, 0].numpy(), int(delta[0, 0])


PIECES = [
    [4, ("video", 4, 4, 6, 1.0), 3],
    [2, ("image", 4, 4), 3, ("video", 6, 2, 4, 0.2), 5],
    [("video", 3, 6, 2, 0.857142865), 4, ("image", 2, 6)],
    [5, ("video", 8, 2, 2, 2.5), 1],
]


@pytest.mark.parametrize("pieces", PIECES)
def test_qwen2_vl_video_positions_match_transformers(pieces):
    ids, items, _ = layout(pieces)
    want, want_delta = hf_positions(
        Qwen2VLModel,
        Qwen2VLConfig(vision_config={"spatial_merge_size": MERGE}),
        ids,
        items,
        layout(pieces)[2],
    )
    got, delta = mrope_input_positions(len(ids), items, MERGE)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta


@pytest.mark.parametrize("pieces", PIECES)
def test_qwen2_5_vl_time_aligned_positions_match_transformers(pieces):
    ids, items, videos = layout(pieces)
    config = Qwen2_5_VLConfig(vision_config={"spatial_merge_size": MERGE, "tokens_per_second": 2})
    want, want_delta = hf_positions(Qwen2_5_VLModel, config, ids, items, videos)
    intervals = [1.0 if v is None else position_step(2.0, v) for v in videos]
    got, delta = mrope_input_positions(len(ids), items, MERGE, intervals)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta


def test_position_step_is_one_for_models_without_a_rate():
    assert position_step(0.0, 0.3) == 1.0
    assert position_step(2.0, 0.3) == pytest.approx(0.6)


@pytest.mark.parametrize("section", [(24, 20, 20), (6, 5, 5), (4, 6, 6)])
def test_interleaved_rotary_matches_transformers(section):
    head_dim = 2 * sum(section)
    config = Qwen3VLTextConfig(
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": list(section)},
    )
    theirs = Qwen3VLTextRotaryEmbedding(config)
    ours = InterleavedMRotaryEmbedding(head_dim, 5e6, section, max_positions=600)
    positions = torch.randint(0, 600, (3, 40), generator=torch.Generator().manual_seed(1))
    want_cos, want_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    generator = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(40, 4, head_dim, generator=generator),
        torch.randn(40, 2, head_dim, generator=generator),
    )
    got_q, got_k = ours(positions, q.clone(), k.clone())
    cos, sin = want_cos[0][:, None, :], want_sin[0][:, None, :]  # [T, 1, D]
    for got, x in ((got_q, q), (got_k, k)):
        rotated_half = torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)
        torch.testing.assert_close(got, x * cos + rotated_half * sin, rtol=0, atol=1e-5)

"""`one_width`: a step that encodes still images (the frame once) with videos gets arrays that
concatenate, the images' frames repeated over T exactly as transformers' processor lays them."""

from __future__ import annotations

import numpy as np

from mmserve.model_config import VisionConfig
from mmserve.worker.model_runner import one_width

VISION = VisionConfig(
    family="qwen2_vl",
    depth=1,
    dim=8,
    num_heads=1,
    mlp_dim=8,
    out_dim=8,
    hidden_act="quick_gelu",
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
)


def test_images_beside_a_video_get_their_frame_repeated_over_t() -> None:
    rng = np.random.default_rng(0)
    image = rng.random((4, 3 * 2 * 2), dtype=np.float32)  # [N, C·P·P]
    video = rng.random((8, 3 * 2 * 2 * 2), dtype=np.float32)  # [N, C·T·P·P]
    widened, same_video = one_width([image, video], VISION)
    assert same_video is video
    expected = np.stack([image.reshape(4, 3, 4)] * 2, axis=2).reshape(4, 24)  # (C, T, P·P) order
    np.testing.assert_array_equal(widened, expected)


def test_arrays_of_one_width_are_passed_through() -> None:
    images = [np.zeros((4, 12), np.float32), np.ones((16, 12), np.float32)]
    assert all(a is b for a, b in zip(one_width(images, VISION), images, strict=True))

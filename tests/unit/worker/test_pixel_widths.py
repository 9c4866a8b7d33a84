"""`one_width`: a step that encodes still images (the frame once) with videos gets pixels that
concatenate, the images' frames repeated over T exactly as transformers' processor lays them."""

from __future__ import annotations

import torch

from mmserve.models.qwen2_vl.vision import one_width


def test_images_beside_a_video_get_their_frame_repeated_over_t() -> None:
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(4, 3 * 2 * 2, generator=generator)  # [N, C·P·P]
    video = torch.rand(8, 3 * 2 * 2 * 2, generator=generator)  # [N, C·T·P·P]
    widened, same_video = one_width([image, video], channels=3)
    assert same_video is video
    expected = torch.stack([image.reshape(4, 3, 4)] * 2, dim=2).reshape(4, 24)  # (C, T, P·P) order
    torch.testing.assert_close(widened, expected, rtol=0, atol=0)


def test_pixels_of_one_width_are_passed_through() -> None:
    images = [torch.zeros(4, 12), torch.ones(16, 12)]
    assert all(a is b for a, b in zip(one_width(images, channels=3), images, strict=True))

"""Videos through the preprocess pool: worker processes, the content-hash cache, sampling in
the hash, and the refusals that come from the header before any frame is decoded."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.videos import Clip, clip_frames, encode_blank, encode_clip
from preprocess import EmptyVideo, FrameSampling, VideoSource, VideoTooLarge
from preprocess.qwen_vl_video import QwenVLVideoSettings
from preprocess.video import plan, sample_indices

SETTINGS = QwenVLVideoSettings.from_hf_config(
    json.loads((checkpoint("qwen2_vl") / "video_preprocessor_config.json").read_text()), clip_bound=False
)
CLIP = encode_clip(Clip(96, 64, 12))


def source(data: bytes = CLIP, settings: QwenVLVideoSettings = SETTINGS, **sampling) -> VideoSource:
    return VideoSource(settings, data, sampling=FrameSampling(**sampling))


def test_a_video_is_processed_in_a_worker_and_cached_by_content_and_sampling(make_pool):
    pool = make_pool(num_workers=1)
    with pool.process(source(num_frames=4)) as first:
        assert first.grid_thw == (2, 8, 10)
        assert first.num_tokens == 2 * 8 * 10 // 4
        assert first.video_info.frames_indices == (0, 4, 7, 11)
        pixels = np.array(first.pixel_values)
    with pool.process(source(num_frames=4)) as again:
        np.testing.assert_array_equal(again.pixel_values, pixels)
        assert again.video_info == first.video_info
    with pool.process(source(num_frames=6)) as other:
        assert other.mm_hash != first.mm_hash and other.grid_thw == (3, 8, 10)
    stats = pool.stats()
    assert (stats.cache_hits, stats.tasks_submitted) == (1, 2)


def test_async_processing_gives_the_same_video(make_pool):
    pool = make_pool(num_workers=1)

    async def both():
        return await asyncio.gather(pool.process_async(source(fps=5)), pool.process_async(source(fps=5)))

    first, second = asyncio.run(both())
    assert first.mm_hash == second.mm_hash and first.video_info.frames_indices == (0, 2, 4, 7, 9, 11)
    first.release()
    second.release()


def test_frames_given_offline_are_used_as_given():
    frames = clip_frames(Clip(72, 72, 5))
    video = plan(VideoSource.from_frames(frames, SETTINGS))
    assert video.info.frames_indices == tuple(range(5)) and video.info.fps is None
    assert video.grid[0] == 3  # five frames: the last temporal patch repeats the last frame


@pytest.mark.parametrize(
    "total,fps,sampling,expected",
    [
        (12, 10.0, {"num_frames": 4}, [0, 4, 7, 11]),
        (12, 10.0, {"num_frames": 50}, list(range(12))),  # never more than the video has
        (30, 10.0, {"fps": 2}, [0, 6, 12, 17, 23, 29]),  # 3 s × 2 per second, spread over the video
        (5, None, {"fps": 24}, list(range(5))),  # no rate in the header: 24 assumed
    ],
)
def test_frames_are_sampled_evenly_first_and_last_included(total, fps, sampling, expected):
    assert sample_indices(total, fps, FrameSampling(**sampling), SETTINGS).tolist() == expected


def test_the_decoding_cost_is_refused_from_the_header():
    settings = QwenVLVideoSettings(max_decoded_pixels=200 * 64 * 64)
    with pytest.raises(VideoTooLarge, match="decodes"):
        plan(source(encode_blank(64, 64, 300), settings, num_frames=2))
    plan(source(encode_blank(64, 64, 150), settings, num_frames=2))  # within the limit


def test_qwen3_vl_needs_two_frames():
    settings = QwenVLVideoSettings(clip_bound=True, patch_size=16)
    with pytest.raises(EmptyVideo, match="at least 2"):
        plan(VideoSource.from_frames(clip_frames(Clip(64, 64, 1)), settings))


def test_sampling_options_are_checked():
    with pytest.raises(ValueError, match="exclusive"):
        FrameSampling(num_frames=2, fps=1.0)
    with pytest.raises(ValueError, match="fps"):
        FrameSampling(fps=0)

"""Our video preprocessing against transformers' Qwen video processors, through the committed
fixtures of `tests/fixtures/video/make_video_reference.py` (transformers' video processors need
torchvision, which the test venv cannot import): the same frames decoded, the same sampled
indices, and pixel_values bit for bit (sha256 of the float32 arrays)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.video_cases import FAMILIES, VIDEO_CASES
from mmserve.testing.videos import clip_frames, encode_clip
from preprocess.qwen_vl_video import QwenVLVideoSettings
from preprocess.video import FrameSampling, VideoSource, plan, process_video
from preprocess.video_decode import decode_frames

REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "video" / "reference.json").read_text())


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def video_settings(family: str) -> QwenVLVideoSettings:
    config = json.loads((checkpoint(family) / "video_preprocessor_config.json").read_text())
    return QwenVLVideoSettings.from_hf_config(config, clip_bound=family == "qwen3_vl")


def source_for(case, settings: QwenVLVideoSettings) -> VideoSource:
    if case.offline_frames:
        return VideoSource.from_frames(clip_frames(case.clip), settings)
    sampling = FrameSampling(num_frames=case.num_frames, fps=case.fps)
    return VideoSource(settings, encode_clip(case.clip), sampling=sampling)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", VIDEO_CASES, ids=[c.name for c in VIDEO_CASES])
def test_pixels_equal_transformers_video_processor(family, case):
    expected = REFERENCE[family][case.name]
    source = source_for(case, video_settings(family))
    arrays = {}
    grid, info = process_video(source, lambda shape: arrays.setdefault("out", np.zeros(shape, np.float32)))
    assert list(grid) == expected["video_grid_thw"]
    assert info.total_num_frames == expected["total_num_frames"]
    if not case.offline_frames:
        assert list(info.frames_indices) == expected["frames_indices"]
        assert info.fps == expected["fps"]
        frames = decode_frames(source.data, np.asarray(info.frames_indices), source.settings)
        assert digest(frames) == expected["frames_digest"], (
            "decoded frames differ from transformers' PyAV reader"
        )
    assert digest(arrays["out"]) == expected["pixel_values_digest"]


@pytest.mark.parametrize("family", FAMILIES)
def test_grid_from_the_header_equals_the_processed_grid(family):
    """The frontend expands placeholders from `plan` (header only) while the pool makes pixels."""
    for case in VIDEO_CASES:
        source = source_for(case, video_settings(family))
        assert list(plan(source).grid) == REFERENCE[family][case.name]["video_grid_thw"]

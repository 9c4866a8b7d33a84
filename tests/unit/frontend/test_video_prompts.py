"""Videos in prompts: placeholders matched to videos (never silently dropped), limits counted
per modality, Qwen3-VL's one feature per temporal patch, and the config's video budget."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mmserve.config import MultiModalConfig
from mmserve.engine_args import EngineArgs
from mmserve.frontend.chat_parsing import PromptError
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.protocol import EngineRequest, MultiModalFeature, decode_add, encode_add
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.videos import Clip, clip_frames

FRAMES = clip_frames(Clip(64, 64, 4))
VIDEO_PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>What?<|im_end|>\n"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def frontend(request):
    config = EngineArgs(checkpoint(request.param), preprocess_workers=0).create_engine_config()
    frontend = build_frontend(config, MediaLoader(), open_ended=False)
    yield frontend
    frontend.close()


def test_a_video_without_its_placeholder_is_refused_not_dropped(frontend):
    with pytest.raises(PromptError, match=re.escape("0 <|video_pad|> placeholders for 1 videos")):
        frontend.inputs.prompt({"prompt": "Describe.", "multi_modal_data": {"video": FRAMES}})


def test_videos_are_counted_against_their_own_limit(frontend):
    with pytest.raises(PromptError, match="at most 1 videos"):
        frontend.inputs.prompt({"prompt": VIDEO_PROMPT * 2, "multi_modal_data": {"video": [FRAMES, FRAMES]}})


def test_video_features_cover_every_video_token(frontend):
    prompt = frontend.inputs.prompt({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": FRAMES}})
    pad = frontend.tokenizer.token_to_id("<|video_pad|>")
    positions = [i for i, t in enumerate(prompt.token_ids) if t == pad]
    covered = [i for f in prompt.features for i in range(f.offset, f.offset + f.length)]
    assert covered == positions
    assert all(f.modality == "video" for f in prompt.features)
    if frontend.inputs.processor.video_settings.clip_bound:  # Qwen3-VL: timestamps between patches
        assert len(prompt.features) == 2 and prompt.features[1].mm_hash.endswith("-1")
        assert all(f.grid_thw[0] == 1 for f in prompt.features)
    else:
        [feature] = prompt.features
        # Qwen2.5-VL: tokens_per_second 2 × (2 frames a patch / 24 frames a second)
        assert feature.grid_thw[0] == 2 and feature.position_step == pytest.approx(2 * 2 / 24)


def test_video_features_and_their_pixels_go_to_the_engine_once(frontend):
    prompt = frontend.inputs.prompt({"prompt": VIDEO_PROMPT, "multi_modal_data": {"video": FRAMES}})
    assert prompt.arrays.keys() == {f.mm_hash for f in prompt.features}
    media = frontend.inputs.media
    first = media.engine_request(prompt, "r1", SamplingParams(), 0.0)
    again = media.engine_request(prompt, "r2", SamplingParams(), 0.0)  # n > 1, or a repeat
    prompt.release()
    assert first.mm_arrays.keys() == prompt.arrays.keys() and not first.mm_handles  # copied, not by handle
    assert again.mm_arrays == {} and again.mm_handles == {}  # by hash: the engine stores them
    received = decode_add([bytes(f) for f in encode_add(first)])
    for mm_hash, pixels in prompt.arrays.items():
        np.testing.assert_array_equal(received.mm_arrays[mm_hash], pixels)


def test_video_fields_cross_the_wire():
    feature = MultiModalFeature("h", 3, 4, (2, 4, 4), modality="video", position_step=0.5)
    request = EngineRequest(
        request_id="r",
        prompt_token_ids=[1] * 8,
        mm_features=[feature],
        sampling_params=SamplingParams(),
        arrival_time=0,
        mm_arrays={"h": np.ones((32, 8), np.float32)},
    )
    received = decode_add([bytes(f) for f in encode_add(request)])
    assert received.mm_features == [feature]
    np.testing.assert_array_equal(received.mm_arrays["h"], np.ones((32, 8), np.float32))


def test_the_encoder_budget_fits_the_largest_video():
    config = EngineArgs(checkpoint("qwen2_vl"), preprocess_workers=0).create_engine_config()
    largest_video = min(config.model.max_video_tokens, config.model.max_model_len)  # (capped by the context)
    assert config.encoder_budget == largest_video > config.model.max_image_tokens
    no_video = EngineArgs(checkpoint("qwen2_vl"), limit_mm_per_prompt={"image": 2, "video": 0})
    assert no_video.create_engine_config().encoder_budget == config.model.max_image_tokens


def test_unknown_modalities_are_refused():
    with pytest.raises(ValueError, match="audio"):
        MultiModalConfig(limit_per_prompt={"audio": 1})

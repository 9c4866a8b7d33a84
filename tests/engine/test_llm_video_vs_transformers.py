"""Videos through the whole engine (`LLM.chat` with `video_url` parts, `LLM.generate` with
frames), token for token against transformers on the same folder, in float32.

transformers' processors cannot run here (they need torchvision): the expanded prompt token ids
come from the committed fixtures (`tests/fixtures/video`), and transformers' model is given the
pixels our preprocessing makes, after checking them against the fixtures' digests. Steps are 12
tokens, so every video is prefilled in chunks that cut through its placeholder tokens.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import (
    Reference,
    VisionInputs,
    generate_with_vision,
    png_bytes,
    synthetic_image,
)
from mmserve.testing.video_cases import VIDEO_CASES, case_messages
from mmserve.testing.videos import clip_frames, encode_clip, frames_as_images
from preprocess.qwen_vl_video import QwenVLVideoSettings
from preprocess.video import FrameSampling, VideoSource, process_video

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
STEP_TOKENS = 12
REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures" / "video" / "reference.json").read_text())
MIME = {"mp4": "video/mp4", "webm": "video/webm", "gif": "image/gif"}


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=STEP_TOKENS, num_kv_blocks=512) as engine:
        yield engine


def video_pixels(model_dir: Path, family: str, case) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Our pixels for the case, checked bit for bit against transformers' (fixture digest)."""
    config = json.loads((model_dir / "video_preprocessor_config.json").read_text())
    settings = QwenVLVideoSettings.from_hf_config(config, clip_bound=family == "qwen3_vl")
    if case.offline_frames:
        source = VideoSource.from_frames(clip_frames(case.clip), settings)
    else:
        sampling = FrameSampling(num_frames=case.num_frames, fps=case.fps)
        source = VideoSource(settings, encode_clip(case.clip), sampling=sampling)
    arrays = {}
    grid, _ = process_video(source, lambda shape: arrays.setdefault("pixels", np.zeros(shape, np.float32)))
    pixels = arrays["pixels"]
    assert hashlib.sha256(pixels.tobytes()).hexdigest() == REFERENCE[family][case.name]["pixel_values_digest"]
    return pixels, grid


def expected_tokens(reference, model_dir, family, case, token_ids) -> list[int]:
    pixels, grid = video_pixels(model_dir, family, case)
    images, image_grids = [], []
    if case.image_size:
        out = reference.image_processor(images=[case_image(case)], return_tensors="np")
        images, image_grids = [out["pixel_values"].astype(np.float32)], [tuple(out["image_grid_thw"][0])]
    vision = VisionInputs(
        images, image_grids, [pixels], [grid], REFERENCE[family][case.name].get("second_per_grid_ts")
    )
    return generate_with_vision(reference, token_ids, vision, MAX_TOKENS).token_ids


def case_image(case):
    return synthetic_image(*case.image_size, seed=7)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_messages(case) -> list[dict]:
    parts = []
    if case.image_size:
        parts.append(
            {"type": "image_url", "image_url": {"url": data_url(png_bytes(case_image(case)), "image/png")}}
        )
    url = data_url(encode_clip(case.clip), MIME[case.clip.container])
    parts += [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": case.question}]
    return [{"role": "user", "content": parts}]


def run_case(llm, reference, case):
    if case.offline_frames:
        text = reference.tokenizer.apply_chat_template(
            case_messages(case), tokenize=False, add_generation_prompt=True
        )
        frames = frames_as_images(clip_frames(case.clip))
        [out] = llm.generate({"prompt": text, "multi_modal_data": {"video": frames}}, GREEDY)
        return out
    options = {"num_frames": case.num_frames} if case.num_frames else {"fps": case.fps}
    [out] = llm.chat(chat_messages(case), GREEDY, mm_processor_kwargs=options)
    return out


@pytest.mark.parametrize("case", VIDEO_CASES, ids=[c.name for c in VIDEO_CASES])
def test_video_prompt_and_tokens_match_transformers(llm, reference, model_dir, family, case):
    out = run_case(llm, reference, case)
    expected_ids = REFERENCE[family][case.name]["prompt_token_ids"]
    assert out.prompt_token_ids == expected_ids, "placeholders/timestamps differ from transformers' processor"
    video_pad = reference.model.config.video_token_id
    assert expected_ids.count(video_pad) > STEP_TOKENS, "the video must span several steps"
    assert out.outputs[0].token_ids == expected_tokens(reference, model_dir, family, case, expected_ids)


def test_second_turn_reuses_the_video_from_the_prefix_cache(llm, reference, model_dir, family):
    case = VIDEO_CASES[0]
    options = {"num_frames": case.num_frames}
    [first] = llm.chat(chat_messages(case), GREEDY, mm_processor_kwargs=options)
    before = llm.stats()
    follow_up = [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And then?"},
    ]
    [second] = llm.chat(chat_messages(case) + follow_up, GREEDY, mm_processor_kwargs=options)
    after = llm.stats()
    video_end = max(
        i for i, t in enumerate(second.prompt_token_ids) if t == reference.model.config.video_token_id
    )
    assert second.num_cached_tokens > video_end, "every video token came from the prefix cache"
    assert after.encoder_runs == before.encoder_runs
    assert second.outputs[0].token_ids == expected_tokens(
        reference, model_dir, family, case, second.prompt_token_ids
    )

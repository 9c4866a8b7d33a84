"""Malformed and hostile videos get a clear 4xx and never disturb the server: after each one,
a valid video request still returns exactly the tokens the offline engine gives. The server
runs the tiny Qwen3-VL with `--limit-mm-per-prompt` and `--media-io-kwargs` set."""

from __future__ import annotations

import base64

import httpx
import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import ServerProcess
from mmserve.testing.videos import Clip, encode_blank, encode_clip

GOOD = encode_clip(Clip(96, 64, 12))
WEBM = encode_clip(Clip(64, 64, 10, container="webm"))


def video_url(data: bytes, media: str = "video/mp4") -> dict:
    return {
        "type": "video_url",
        "video_url": {"url": f"data:{media};base64," + base64.b64encode(data).decode()},
    }


def chat(*parts, **extra) -> dict:
    content = [*parts, {"type": "text", "text": "What happens?"}]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 6, **extra}


VALID = chat(video_url(GOOD))

# (case id, body, text the error message must contain)
CASES = [
    ("not_a_video", chat(video_url(b"\x00\x01 this is not a video" * 50)), "not a video"),
    ("truncated_mp4", chat(video_url(GOOD[: len(GOOD) // 2])), "not a video"),
    ("truncated_webm", chat(video_url(WEBM[: len(WEBM) * 2 // 3], "video/webm")), "truncated"),
    ("zero_frames", chat(video_url(encode_blank(64, 64, 0, "webm"), "video/webm")), "before its first frame"),
    ("ten_thousand_frames", chat(video_url(encode_blank(16, 16, 10_000))), "10,000 frames"),
    ("huge_frames", chat(video_url(encode_blank(4096, 2304, 1))), "4096x2304"),
    ("an_image_as_video", chat(video_url(png_bytes(synthetic_image(32, 32, 0)), "image/png")), "not a video"),
    ("two_videos_over_the_limit", chat(video_url(GOOD), video_url(GOOD)), "at most 1 videos"),
    ("num_frames_zero", chat(video_url(GOOD), mm_processor_kwargs={"num_frames": 0}), "num_frames"),
    ("unknown_option", chat(video_url(GOOD), mm_processor_kwargs={"frames": 3}), "num_frames"),
    ("no_url", chat({"type": "video_url", "video_url": {}}), "video_url.url"),
]


@pytest.fixture(scope="module")
def model_path():
    return checkpoint("qwen3_vl")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(
        model_path,
        "--preprocess-workers",
        "1",
        "--limit-mm-per-prompt",
        '{"image": 2, "video": 1}',
        "--media-io-kwargs",
        '{"video": {"num_frames": 4}}',
        log_path=tmp_path_factory.mktemp("server") / "log",
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expected_valid_text(model_path) -> str:
    with LLM(model_path, num_kv_blocks=256, media_io_kwargs={"video": {"num_frames": 4}}) as llm:
        [out] = llm.chat(VALID["messages"], SamplingParams(temperature=0, max_tokens=6))
    return out.outputs[0].text


@pytest.mark.parametrize("name,body,text", CASES, ids=[c[0] for c in CASES])
def test_bad_video_gets_a_clear_4xx_and_the_server_stays_correct(
    server, expected_valid_text, name, body, text
):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert text in error["message"], error
    assert httpx.get(server.url + "/health").status_code == 200
    valid = httpx.post(server.url + "/v1/chat/completions", json=VALID, timeout=60)
    assert valid.status_code == 200, valid.text
    assert valid.json()["choices"][0]["message"]["content"] == expected_valid_text


def test_a_request_may_sample_its_video_differently(server):
    """mm_processor_kwargs overrides the server's num_frames: more frames, more prompt tokens."""
    usage = [
        httpx.post(
            server.url + "/v1/chat/completions", json=chat(video_url(GOOD), **extra), timeout=60
        ).json()["usage"]["prompt_tokens"]
        for extra in ({}, {"mm_processor_kwargs": {"num_frames": 8}})
    ]
    assert usage[1] > usage[0]

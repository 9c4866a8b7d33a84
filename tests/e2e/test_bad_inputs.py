"""Bad requests get the right 4xx with an OpenAI error body, and never disturb the server:
after each one, a valid request still returns exactly the expected tokens."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import png_bytes, synthetic_image

VALID = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0, "max_tokens": 8}


def b64(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_with(*parts, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}],
        "max_tokens": 4,
        **extra,
    }


def bomb_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")  # 400 M pixels, a few KB compressed
    return buf.getvalue()


GOOD_PNG = png_bytes(synthetic_image(64, 64, seed=0))

# (case id, body — dict, or raw bytes sent as is —, route, expected status, text the message must contain)
CASES = [
    ("malformed_json", b'{"messages": [', "/v1/chat/completions", 400, "not valid JSON"),
    ("body_is_a_list", b"[1, 2]", "/v1/chat/completions", 400, "JSON object"),
    ("no_messages", {"max_tokens": 3}, "/v1/chat/completions", 400, "messages"),
    ("empty_messages", {"messages": []}, "/v1/chat/completions", 400, "messages"),
    ("messages_not_a_list", {"messages": "hi"}, "/v1/chat/completions", 400, "messages"),
    ("message_not_an_object", {"messages": ["hi"]}, "/v1/chat/completions", 400, "must be an object"),
    (
        "unknown_role",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "/v1/chat/completions",
        400,
        "role",
    ),
    (
        "content_is_a_number",
        {"messages": [{"role": "user", "content": 5}]},
        "/v1/chat/completions",
        400,
        "content",
    ),
    (
        "unknown_part_type",
        chat_with({"type": "audio_url", "audio_url": {"url": "x"}}),
        "/v1/chat/completions",
        400,
        "not supported",
    ),
    (
        "bad_base64",
        chat_with(image_part("data:image/png;base64,@@@not-base64@@@")),
        "/v1/chat/completions",
        400,
        "base64",
    ),
    (
        "data_url_not_an_image",
        chat_with(image_part(b64(b"hello", "text/plain"))),
        "/v1/chat/completions",
        400,
        "not an image",
    ),
    (
        "data_url_without_comma",
        chat_with(image_part("data:image/png;base64")),
        "/v1/chat/completions",
        400,
        "malformed data URL",
    ),
    (
        "truncated_png",
        chat_with(image_part(b64(GOOD_PNG[: len(GOOD_PNG) // 2]))),
        "/v1/chat/completions",
        400,
        "",
    ),
    (
        "not_an_image_at_all",
        chat_with(image_part(b64(b"GIF89a but not really"))),
        "/v1/chat/completions",
        400,
        "",
    ),
    ("decompression_bomb", chat_with(image_part(b64(bomb_png()))), "/v1/chat/completions", 400, "pixels"),
    (
        "file_url_without_root",
        chat_with(image_part("file:///etc/passwd")),
        "/v1/chat/completions",
        400,
        "disabled",
    ),
    (
        "http_url_without_domains",
        chat_with(image_part("http://127.0.0.1:1/x.png")),
        "/v1/chat/completions",
        400,
        "disabled",
    ),
    (
        "unsupported_scheme",
        chat_with(image_part("ftp://example.com/a.png")),
        "/v1/chat/completions",
        400,
        "unsupported",
    ),
    (
        "too_many_images",
        chat_with(*[image_part(b64(GOOD_PNG))] * 9),
        "/v1/chat/completions",
        400,
        "at most 8 images",
    ),
    ("negative_max_tokens", {**VALID, "max_tokens": -1}, "/v1/chat/completions", 400, "max_tokens"),
    ("max_tokens_is_a_string", {**VALID, "max_tokens": "5"}, "/v1/chat/completions", 400, "max_tokens"),
    ("negative_temperature", {**VALID, "temperature": -0.5}, "/v1/chat/completions", 400, "temperature"),
    (  # NaN is not JSON (RFC 8259): the parser refuses it
        "nan_temperature",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        "/v1/chat/completions",
        400,
        "not valid JSON",
    ),
    ("top_p_zero", {**VALID, "top_p": 0}, "/v1/chat/completions", 400, "top_p"),
    ("n_zero", {**VALID, "n": 0}, "/v1/chat/completions", 400, "n"),
    (
        "presence_penalty_out_of_range",
        {**VALID, "presence_penalty": 3},
        "/v1/chat/completions",
        400,
        "presence_penalty",
    ),
    (
        "too_many_top_logprobs",
        {**VALID, "logprobs": True, "top_logprobs": 50},
        "/v1/chat/completions",
        400,
        "top_logprobs",
    ),
    ("stop_is_a_number", {**VALID, "stop": 5}, "/v1/chat/completions", 400, "stop"),
    (
        "stream_options_wrong_type",
        {**VALID, "stream": True, "stream_options": "yes"},
        "/v1/chat/completions",
        400,
        "stream_options",
    ),
    ("unknown_model", {**VALID, "model": "gpt-17"}, "/v1/chat/completions", 404, "does not exist"),
    (
        "prompt_over_the_context",
        {"messages": [{"role": "user", "content": "hello " * 5000}]},
        "/v1/chat/completions",
        400,
        "4096",
    ),
    ("completion_empty_prompt_list", {"prompt": []}, "/v1/completions", 400, "prompt"),
    ("completion_prompt_over_context", {"prompt": [5] * 5000}, "/v1/completions", 400, "5000"),
    ("detokenize_bad_ids", {"tokens": [-1, 10**9]}, "/detokenize", 400, "token ids"),
    (
        "body_over_the_size_limit",
        b'{"messages": "' + b"x" * (2 << 20) + b'"}',
        "/v1/chat/completions",
        413,
        "exceeds",
    ),
]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    from mmserve.testing.server import ServerProcess

    proc = ServerProcess(
        model_path,
        "--preprocess-workers",
        "1",
        "--max-request-body",
        "1MiB",
        log_path=tmp_path_factory.mktemp("server") / "log",
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expected_valid_text(model_path) -> str:
    with LLM(model_path, num_kv_blocks=256) as llm:
        [out] = llm.chat(VALID["messages"], SamplingParams(temperature=0, max_tokens=8))
    return out.outputs[0].text


@pytest.mark.parametrize("name,body,route,status,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error_and_the_server_stays_correct(
    server, expected_valid_text, name, body, route, status, text
):
    if isinstance(body, bytes):
        response = httpx.post(
            server.url + route, content=body, headers={"content-type": "application/json"}, timeout=30
        )
    else:
        response = httpx.post(server.url + route, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and text in error["message"], error
    assert httpx.get(server.url + "/health").status_code == 200
    valid = httpx.post(server.url + "/v1/chat/completions", json=VALID, timeout=30)
    assert valid.status_code == 200
    assert valid.json()["choices"][0]["message"]["content"] == expected_valid_text

"""Request bodies parsed without stalling the loop give exactly what `json.loads` gives: long
strings cut out before parsing (long_strings.py) come back intact, escapes and all; answers
rendered in pieces (responses.py) are Starlette's bytes; the answer-size bounds (limits.py)."""

from __future__ import annotations

import base64
import json
import random

import pytest

from mmserve.entrypoints.openai import long_strings
from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.limits import MAX_CHOICES, check_answer_size, check_prompt_logprobs_size
from mmserve.entrypoints.openai.parsing import MAX_JSON_CONTAINERS, decode_json
from mmserve.entrypoints.openai.responses import answer_bytes, free_in_pieces, render_json
from mmserve.frontend.media import RawDataUrl, decode_data_url
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.sampling_params import SamplingParams

LONG = long_strings.MIN_BYTES + 17


def plain(value: object) -> object:
    """`value` with each RawDataUrl turned back into the text it stands for."""
    if isinstance(value, RawDataUrl):
        return bytes(value.data).decode()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def bodies() -> list[bytes]:
    rng = random.Random(0)
    data_url = "data:image/png;base64," + base64.b64encode(rng.randbytes(LONG)).decode()
    tricky = [
        "a" * LONG,  # long, plain: cut out
        'q"uote' * (LONG // 6),  # long with escapes: left in place
        "\\" * LONG,  # long run of backslashes
        "é€𝄞" * (LONG // 3),  # multi-byte UTF-8, plain
        "x" * LONG + "\n",  # a control character (escaped in JSON): left in place
        "short",
    ]
    found = []
    for text in tricky:
        messages = [{"role": "user", "content": [image_part(data_url), {"type": "text", "text": text}]}]
        found.append(json.dumps({"messages": messages, "stop": [text[:10]]}, ensure_ascii=False).encode())
    # A quote-free stretch outside any string (a long array of numbers) next to long strings.
    numbers = {"a": "b" * LONG, "numbers": list(range(20_000)), "c": "d" * LONG}
    found.append(json.dumps(numbers, separators=(",", ":")).encode())
    # Escaped quotes right before a long string: `"\\\\"` ends its string, `"\\""` does not.
    found.append(b'{"x": "\\\\", "y": "\\"", "z": "' + b"k" * LONG + b'"}')
    return found


@pytest.mark.parametrize("body", bodies(), ids=lambda b: f"{len(b)}-bytes")
def test_cutting_long_strings_out_changes_nothing_parsed(body: bytes) -> None:
    assert plain(decode_json(body)) == json.loads(body)


def test_a_long_data_url_stays_bytes_and_decodes_like_the_string() -> None:
    payload = random.Random(1).randbytes(3 * LONG)
    url = "data:image/png;base64," + base64.b64encode(payload).decode()
    parsed = decode_json(json.dumps({"messages": [{"content": [image_part(url)]}]}).encode())
    raw = parsed["messages"][0]["content"][0]["image_url"]["url"]
    assert isinstance(raw, RawDataUrl)
    assert decode_data_url(raw, 1 << 30) == decode_data_url(url, 1 << 30) == payload


def test_a_forged_marker_is_ordinary_text() -> None:
    body = json.dumps({"a": "\u0000deadbeefdeadbeef:0", "b": "z" * LONG}).encode()
    assert plain(decode_json(body)) == json.loads(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [' + b",".join([b"{}"] * (MAX_JSON_CONTAINERS + 1)) + b"]}",
        b'{"t": NaN}',
        b'{"t": 1e400}',
        b'{"t": "\\ud800"}',
        b'{"t": "' + b"a" * LONG + b"\xff" + b"a" * LONG + b'"}',  # bad UTF-8 inside a cut string
    ],
    ids=["too_many_containers", "nan", "huge_number", "lone_surrogate", "bad_utf8_in_long_string"],
)
def test_bodies_beyond_json_or_the_bounds_are_400s(body: bytes) -> None:
    with pytest.raises(OpenAIError) as raised:
        decode_json(body)
    assert raised.value.status == 400


@pytest.mark.parametrize(
    "value",
    [
        {"choices": [{"logprobs": {"content": [{"token": "é", "logprob": -0.5, "bytes": [195]}] * 500}}]},
        {"a": [1, 2, 3], "b": {"c": [[1] * 300, "x"]}, "d": None, "e": "\u2028"},
        [{"k": list(range(1000))}] * 3,
        {1: "non-string key"},
    ],
)
def test_answers_rendered_in_pieces_are_starlettes_bytes(value: object) -> None:
    expected = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    assert render_json(value) == expected


def test_an_answer_is_rendered_then_taken_apart_with_its_outputs() -> None:
    logprobs = [{7: Logprob(-0.1, 1, "a")} for _ in range(1000)]
    output = RequestOutput(
        "r", None, [1], [CompletionOutput(0, "a" * 1000, [7] * 1000, logprobs=logprobs)], True
    )
    built: list[dict] = []

    def build(outputs: list[RequestOutput]) -> dict:
        completion = outputs[0].outputs[0]
        built.append(
            {
                "choices": [
                    {"logprobs": {"content": [{"t": entry[7].logprob} for entry in completion.logprobs]}}
                ]
            }
        )
        return built[0]

    expected = render_json(build([output]))
    built.clear()
    owned = [[output]]
    assert answer_bytes(build, owned) == expected
    assert owned == [] and logprobs == [] and built[0] == {}  # taken apart in the thread


def test_free_in_pieces_empties_every_level() -> None:
    value = {"a": [{"b": [[1] * 500]}], "c": "x"}
    free_in_pieces(value)
    assert value == {}


def test_answer_size_bounds() -> None:
    check_answer_size(SamplingParams(n=16, max_tokens=300, logprobs=20), 1, 4096)  # ~7 MB: fine
    with pytest.raises(OpenAIError, match="the answer could reach"):
        check_answer_size(SamplingParams(n=128, max_tokens=300, logprobs=20), 1, 4096)
    with pytest.raises(OpenAIError, match="choices"):
        check_answer_size(SamplingParams(n=2, max_tokens=1), MAX_CHOICES, 4096)
    with pytest.raises(OpenAIError, match="lower n, max_tokens"):  # no max_tokens: the whole context
        check_answer_size(SamplingParams(n=64, logprobs=5, max_tokens=None), 1, 4096)
    check_prompt_logprobs_size(SamplingParams(prompt_logprobs=5), [4000], 1)
    with pytest.raises(OpenAIError, match="prompt log-probabilities"):
        check_prompt_logprobs_size(SamplingParams(prompt_logprobs=20), [4000], 128)

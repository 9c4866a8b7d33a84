"""Issue 20's hostile and odd traffic, table-driven like test_hostile_inputs.py: images and
bodies built to cost the server (container parts, JSON values, answer size), truncated images,
routes that do not exist, requests a web page could make (content types, Origin, Host), and
special-token text typed into messages. Each case gets its status with an OpenAI error body
(or, for special-token text, a correct answer), then /health is 200 and the canary request
returns exactly the offline answer.

Connection limits, the drain, the event-loop watchdog and worker deaths have their own files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest
from reliability_util import (
    CHAT,
    Case,
    Hardened,
    assert_openai_error,
    assert_still_serving,
    chat,
    data_url,
    encode,
    fd_count,
    image_bytes,
    materialise,
)

from mmserve.entrypoints.openai.parsing import MAX_JSON_CONTAINERS
from mmserve.testing.hostile_images import (
    arithmetic_jpeg,
    gif_with_comment_blocks,
    gif_with_empty_extensions,
    jpeg_claiming,
    jpeg_with_comments,
    png_chunk,
    png_with_empty_chunks,
    progressive_with_scans,
    tiff,
)
from mmserve.testing.reference import synthetic_image
from preprocess.structure import (
    MAX_GIF_BLOCKS,
    MAX_JPEG_HEADER_SEGMENTS,
    MAX_JPEG_SCANS,
    MAX_PNG_CHUNKS,
    MAX_TIFF_STRIPS,
    MAX_TIFF_TAGS,
)

PHOTO = synthetic_image(96, 64, seed=7)
PHOTO_JPEG = encode(PHOTO, "JPEG", quality=90)


def jpeg(data: bytes) -> dict:
    return image_bytes(data, "image/jpeg")


def png_idat_halved() -> bytes:
    """The pixel data cut in half, re-chunked with a valid CRC and a proper end."""
    png = encode(PHOTO, "PNG")
    start = png.index(b"IDAT") - 4
    length = int.from_bytes(png[start : start + 4], "big")
    pixels = png[start + 8 : start + 8 + length]
    return png[:start] + png_chunk(b"IDAT", pixels[: length // 2]) + png_chunk(b"IEND", b"")


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


BOUNDED: list[Case] = [
    # --- class 3: parts Pillow walks one by one in Python (seconds for millions of them)
    Case("png_chunks_before_pixels", image_bytes(png_with_empty_chunks(MAX_PNG_CHUNKS)), 400, "chunks"),
    Case(
        "png_chunks_after_pixels",
        image_bytes(png_with_empty_chunks(MAX_PNG_CHUNKS, after_image_data=True)),
        400,
        "chunks",
    ),
    Case("jpeg_comment_segments", jpeg(jpeg_with_comments(MAX_JPEG_HEADER_SEGMENTS)), 400, "header segments"),
    Case(
        "gif_comment_sub_blocks",
        image_bytes(gif_with_comment_blocks(MAX_GIF_BLOCKS + 1), "image/gif"),
        400,
        "blocks",
    ),
    Case(
        "gif_empty_extensions",
        image_bytes(gif_with_empty_extensions(MAX_GIF_BLOCKS + 1), "image/gif"),
        400,
        "blocks",
    ),
    Case("tiff_tags", image_bytes(tiff(extra_tags=MAX_TIFF_TAGS), "image/tiff"), 400, "tags"),
    Case("tiff_strips", image_bytes(tiff(strips=MAX_TIFF_STRIPS + 1), "image/tiff"), 400, "strips"),
    # Each scan is a pass over every block in libjpeg: refused in the worker, before decoding.
    Case("progressive_jpeg_scans", jpeg(progressive_with_scans(MAX_JPEG_SCANS + 1)), 400, "scans"),
    # --- class 3: JSON whose parse cost is its number of values, counted first
    Case(
        "json_empty_messages",
        b'{"messages": [' + b",".join([b"{}"] * (MAX_JSON_CONTAINERS + 1)) + b"]}",
        400,
        "JSON objects and arrays",
    ),
    Case(
        "json_nested_arrays",
        b'{"messages": ' + b"[" * 70_000 + b"]" * 70_000 + b"}",
        400,
        "objects and arrays",
    ),
    # --- class 3: answers far larger than the request (was a 179-byte request, a 58 MB answer)
    Case(
        "n128_top_logprobs20_300_tokens",
        chat("hi", n=128, logprobs=True, top_logprobs=20, max_tokens=300),
        400,
        "the answer could reach",
    ),
    Case(
        "logprobs_without_max_tokens_n64",
        {"messages": [{"role": "user", "content": "hi"}], "n": 64, "logprobs": True, "top_logprobs": 5},
        400,
        "lower n, max_tokens",
    ),
    Case(
        "completions_1024_prompts_n2",
        {"prompt": ["a"] * 1024, "n": 2, "max_tokens": 1},
        400,
        "2048 choices",
        "/v1/completions",
    ),
    Case(
        "completions_logprobs_n100_long",
        {"prompt": "a", "n": 100, "logprobs": 20, "max_tokens": 4000},
        400,
        "log-probabilities",
        "/v1/completions",
    ),
    # --- found by the schema fuzzer after the merge: malformed tool_calls were 500s (AttributeError)
    Case(
        "tool_calls_of_strings",
        {"messages": [{"role": "assistant", "tool_calls": ["x"]}, {"role": "user", "content": "hi"}]},
        400,
        "must be an object",
    ),
    Case(
        "tool_calls_not_a_list",
        {"messages": [{"role": "assistant", "tool_calls": "x"}, {"role": "user", "content": "hi"}]},
        400,
        "must be a list",
    ),
    # --- class 4: truncated images (the JPEGs were decoded with grey fill, for seconds)
    Case("jpeg_600_bytes_claiming_5000x5000", jpeg(jpeg_claiming(5000, 5000)), 400, "truncated"),
    Case("jpeg_claiming_7000x7000", jpeg(jpeg_claiming(7000, 7000)), 400, "truncated"),
    Case(
        "progressive_jpeg_claiming_5000x5000",
        jpeg(jpeg_claiming(5000, 5000, progressive=True)),
        400,
        "truncated",
    ),
    Case("jpeg_cut_in_half", jpeg(_half(PHOTO_JPEG)), 400, "truncated"),
    Case(
        "jpeg_cut_at_start_of_scan", jpeg(PHOTO_JPEG[: PHOTO_JPEG.index(b"\xff\xda") + 14]), 400, "truncated"
    ),
    Case("jpeg_header_only", jpeg(PHOTO_JPEG[:20]), 400, "truncated"),
    Case("jpeg_arithmetic_coded", jpeg(arithmetic_jpeg()), 400, "arithmetic"),
    Case("png_pixels_halved_with_valid_crc", image_bytes(png_idat_halved()), 400, "truncated"),
    Case(
        "gif_cut_with_trailer",
        image_bytes(_half(encode(PHOTO.convert("P"), "GIF")) + b"\x00\x3b", "image/gif"),
        400,
        "truncated",
    ),
    Case("webp_cut_in_half", image_bytes(encode(PHOTO, "WEBP")[:200], "image/webp"), 400, ""),
]


@dataclass(frozen=True)
class Http:
    """A request with its own method, headers and body (the table above posts JSON)."""

    id: str
    method: str
    route: str
    status: int
    contains: str = ""
    headers: dict = field(default_factory=dict)
    content: bytes | None = None
    code: object = None  # the error body's code, where it is not the status


VALID_BODY = (
    b'{"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2, "temperature": 0}'
)

ROUTES: list[Http] = [
    # --- class 5: routing's own answers, OpenAI bodies instead of {"detail": ...}
    Http("no_such_route", "GET", "/v1/nope", 404, "no route"),
    Http("typo_in_route", "POST", "/v1/chat/completion", 404, "no route", content=VALID_BODY),
    Http("get_on_a_post_route", "GET", CHAT, 405, "method GET is not allowed"),
    Http("put_on_completions", "PUT", "/v1/completions", 405, "not allowed", content=b"{}"),
    Http("delete_models", "DELETE", "/v1/models", 405, "not allowed"),
    Http("unknown_model_card", "GET", "/v1/models/gpt-4o", 404, "does not exist", code="model_not_found"),
    Http(
        "model_card_long_id", "GET", "/v1/models/" + "m" * 5000, 404, "does not exist", code="model_not_found"
    ),
    Http("missing_static_file", "GET", "/static/nope.js", 404, "no route"),
    # /tokenize checked the model name of no request
    Http(
        "tokenize_wrong_model",
        "POST",
        "/tokenize",
        404,
        "does not exist",
        {"content-type": "application/json"},
        b'{"model": "gpt-4o", "prompt": "x"}',
        code="model_not_found",
    ),
    Http(
        "chat_long_wrong_model",
        "POST",
        CHAT,
        404,
        "does not exist",
        {"content-type": "application/json"},
        b'{"model": "' + b"m" * 5000 + b'", "messages": [{"role": "user", "content": "x"}]}',
        code="model_not_found",
    ),
    # --- class 7: bodies a web page can send cross-site without a CORS preflight
    Http(
        "text_plain_body", "POST", CHAT, 415, "application/json", {"content-type": "text/plain"}, VALID_BODY
    ),
    Http(
        "form_body",
        "POST",
        CHAT,
        415,
        "application/json",
        {"content-type": "application/x-www-form-urlencoded"},
        b"messages=x",
    ),
    Http(
        "multipart_body",
        "POST",
        CHAT,
        415,
        "got multipart/form-data",
        {"content-type": "multipart/form-data"},
        b"",
    ),
    Http("no_content_type", "POST", CHAT, 415, "got none", {}, VALID_BODY),
    Http("jsonp_content_type", "POST", CHAT, 415, "", {"content-type": "application/jsonp"}, VALID_BODY),
    Http(
        "text_json_content_type",
        "POST",
        "/tokenize",
        415,
        "",
        {"content-type": "text/json"},
        b'{"prompt": "x"}',
    ),
    # --- class 7: a page on another origin (answering without CORS headers would still run it)
    Http(
        "foreign_origin_post",
        "POST",
        CHAT,
        403,
        "cross-origin",
        {"origin": "http://evil.example"},
        VALID_BODY,
    ),
    Http("null_origin", "POST", CHAT, 403, "cross-origin", {"origin": "null"}, VALID_BODY),
    Http(
        "foreign_origin_reads_models",
        "GET",
        "/v1/models",
        403,
        "cross-origin",
        {"origin": "https://evil.example"},
    ),
    Http(
        "foreign_origin_preflight",
        "OPTIONS",
        CHAT,
        403,
        "cross-origin",
        {"origin": "https://evil.example", "access-control-request-method": "POST"},
    ),
    Http(
        "loopback_origin_other_port",
        "POST",
        CHAT,
        403,
        "cross-origin",
        {"origin": "http://127.0.0.1:1"},
        VALID_BODY,
    ),
    # --- class 7: DNS rebinding (a page's own name pointed at 127.0.0.1)
    Http(
        "foreign_host", "POST", CHAT, 400, "does not answer to the Host", {"host": "evil.example"}, VALID_BODY
    ),
    Http(
        "rebinding_host_with_port", "GET", "/v1/models", 400, "Host", {"host": "rebind.attacker.example:8000"}
    ),
    Http("loopback_lookalike_host", "GET", "/v1/models", 400, "Host", {"host": "127.0.0.1.nip.io"}),
    Http("foreign_host_health", "GET", "/health", 400, "Host", {"host": "evil.example"}),
    Http("empty_host", "GET", "/v1/models", 400, "Host", {"host": ""}),
]


@pytest.mark.parametrize("case", BOUNDED, ids=[c.id for c in BOUNDED])
def test_costly_or_truncated_request_gets_its_4xx_and_the_server_stays_correct(hardened, valid_answer, case):
    response = hardened.post(case.route, materialise(case.body, hardened))
    error = assert_openai_error(response, case.status, case.contains)
    assert len(error["message"]) < 1000
    assert_still_serving(hardened, valid_answer)


def _send(hardened: Hardened, case: Http) -> httpx.Response:
    """Exactly the case's headers (and the API key); httpx adds no content type to raw bytes."""
    headers = {**hardened.headers, **case.headers}
    return httpx.request(
        case.method, hardened.url + case.route, headers=headers, content=case.content, timeout=60
    )


@pytest.mark.parametrize("case", ROUTES, ids=[c.id for c in ROUTES])
def test_route_browser_and_host_case_gets_its_openai_error(hardened, valid_answer, case: Http):
    response = _send(hardened, case)
    error = assert_openai_error(response, case.status, case.contains)
    assert error["code"] == (case.code if case.code is not None else case.status)
    assert len(error["message"]) < 1000
    if case.status == 405:
        assert response.headers["allow"]
    assert "access-control-allow-origin" not in response.headers
    assert_still_serving(hardened, valid_answer)


@pytest.mark.parametrize(
    "name,headers",
    [
        ("json_with_charset", {"content-type": "application/json; charset=utf-8"}),
        ("json_upper_case", {"content-type": "Application/JSON"}),
        ("same_origin_page", {"origin": "{url}"}),
        ("host_localhost", {"host": "localhost:{port}"}),
        ("host_ipv6_loopback", {"host": "[::1]:{port}"}),
        ("host_with_trailing_dot", {"host": "localhost.:{port}"}),
    ],
)
def test_what_a_browser_on_this_server_or_a_local_client_sends_is_served(
    hardened, valid_answer, name, headers
):
    """Positive controls: the refusals are about where a request comes from, not about fetching."""
    port = hardened.url.rsplit(":", 1)[1]
    filled = {k: v.format(url=hardened.url, port=port) for k, v in headers.items()}
    filled.setdefault("content-type", "application/json")
    if "host" in filled and "origin" not in filled:
        filled["origin"] = f"http://{filled['host']}"  # what a browser on that page sends
    response = httpx.post(
        hardened.url + CHAT, content=VALID_BODY, headers={**hardened.headers, **filled}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == valid_answer


def test_tokenize_honours_add_generation_prompt(hardened):
    """/tokenize rendered the generation prompt whatever the request said."""
    messages = [{"role": "user", "content": "hi"}]
    with_prompt, without = (
        hardened.post("/tokenize", {"messages": messages, "add_generation_prompt": flag}).json()["tokens"]
        for flag in (True, False)
    )
    assert len(with_prompt) > len(without) and with_prompt[: len(without)] == without


def test_model_card_of_the_served_model(hardened):
    listed = httpx.get(hardened.url + "/v1/models", headers=hardened.headers, timeout=10).json()["data"][0]
    card = httpx.get(hardened.url + f"/v1/models/{listed['id']}", headers=hardened.headers, timeout=10)
    assert card.status_code == 200 and card.json() == listed


# ------------------------------------------------------------------------ class 10: descriptors


def test_cached_images_hold_no_descriptor_in_the_server(hardened, valid_answer):
    """Each cached image used to keep a descriptor open: ~1,000 at steady state."""
    before = fd_count(hardened.server.proc.pid)
    for seed in range(40):
        url = data_url(encode(synthetic_image(40, 40, seed=1000 + seed), "PNG"))
        body = chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}])
        body["max_tokens"] = 1
        assert hardened.post(CHAT, body).status_code == 200
    assert fd_count(hardened.server.proc.pid) - before < 10  # sockets come and go; 40 images would be 40
    assert_still_serving(hardened, valid_answer)


def test_the_new_corpus_is_large_and_covers_every_class():
    """Issue 20's corpus: at least 60 new cases with an error body, health and the canary
    checked (here and in test_request_values.py); role injection, n > 1 streams, connections,
    the drain, worker deaths and the watchdog come on top."""
    from test_request_values import TOKEN_IDS

    ids = [c.id for c in BOUNDED] + [c.id for c in ROUTES] + [c.id for c, _ in TOKEN_IDS]
    assert len(ids) >= 60, len(ids)
    assert len(set(ids)) == len(ids)

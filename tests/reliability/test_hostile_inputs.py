"""Hostile input, table-driven: every case gets its documented 4xx with an OpenAI error body, the
server stays healthy, and a valid request right after returns exactly the offline greedy answer.
Valid-but-unusual images are accepted (200). tests/e2e/test_bad_inputs.py holds 35 more cases;
none is repeated here.

Case ids name what is sent; where a case failed before this suite's fixes, its comment says how.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image, ImageSequence
from reliability_util import (
    CHAT,
    GOOD_PNG,
    KV_BLOCKS,
    Case,
    Hardened,
    assert_openai_error,
    assert_still_serving,
    chat,
    encode,
    image_bytes,
    jpeg_with_declared_size,
    materialise,
    png_header_only,
    with_image,
)

from mmserve.testing.reference import synthetic_image


def raw_chat_with(fragment: str) -> bytes:
    return ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, ' + fragment + "}").encode()


BASE = synthetic_image(64, 48, seed=3)
GOOD_B64 = base64.b64encode(GOOD_PNG).decode()

# Every field of a chat request with a value of the wrong JSON type → 400 naming the field.
WRONG_TYPES = {
    "model": 5,
    "n": "2",
    "max_tokens": 1.5,
    "max_completion_tokens": "3",
    "temperature": "0",
    "top_p": [],
    "top_k": 1.0,
    "min_p": {},
    "seed": "1",
    "stop": [1],
    "stop_token_ids": "1",
    "presence_penalty": "x",
    "frequency_penalty": [0.1],
    "repetition_penalty": "1",
    "ignore_eos": "yes",
    "min_tokens": 0.5,
    "skip_special_tokens": 1,
    "include_stop_str_in_output": "no",
    "stream": "true",
    "user": 5,
    "priority": 1.5,
    "logprobs": 1,
    "top_logprobs": "5",
    "chat_template_kwargs": [],
}

CASES: list[Case] = [
    # --- JSON itself
    Case("nested_json_100000_deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "JSON"),
    Case(
        "nested_content_900_deep",
        ('{"messages": [{"role": "user", "content": ' + "[" * 900 + "]" * 900 + "}]}").encode(),
        400,
        "must be an object",
    ),
    # Python refuses int literals over 4300 digits with ValueError: was an unhandled 500 (plain text).
    Case("integer_literal_5000_digits", raw_chat_with('"seed": 1' + "0" * 5000), 400, "not valid JSON"),
    # json.loads keeps "\ud800" as a lone surrogate; tokenizers then raised TypeError: was a 500.
    Case("lone_utf16_surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "surrogate"),
    Case("surrogate_in_stop_string", raw_chat_with('"stop": ["\\udfff"]'), 400, "surrogate"),
    Case("invalid_utf8_bytes", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "JSON"),
    Case("empty_body", b"", 400, "not valid JSON"),
    Case("body_is_a_json_string", b'"messages"', 400, "JSON object"),
    # --- wrong types, one case per field
    *[
        Case(f"wrong_type_{name}", chat("hi", **{name: value}), 400, name)
        for name, value in WRONG_TYPES.items()
    ],
    Case(
        "wrong_type_stream_options_field",
        chat("hi", stream=True, stream_options={"include_usage": "y"}),
        400,
        "include_usage",
    ),
    Case("wrong_type_image_url_object", chat([{"type": "image_url", "image_url": {"url": 5}}]), 400, "url"),
    Case("wrong_type_text_part", chat([{"type": "text", "text": ["a"]}]), 400, "text must be a string"),
    # --- huge strings (the body limit is 1 MiB)
    Case("huge_text_900k", chat("hello " * 150_000), 400, "maximum context length"),
    Case("huge_role_string", {"messages": [{"role": "x" * 900_000, "content": "hi"}]}, 400, "role"),
    Case("huge_part_type_string", chat([{"type": "y" * 900_000}]), 400, "not supported"),
    # --- data URL headers
    Case("data_url_not_base64", with_image("data:image/png," + GOOD_B64), 400, "data URLs must look like"),
    Case("data_url_uppercase_scheme", with_image("DATA:image/png;base64," + GOOD_B64), 400, "unsupported"),
    Case(
        "data_url_mime_line_breaks",
        with_image("data:image/png;base64," + GOOD_B64[:60] + "\n" + GOOD_B64[60:]),
        400,
        "base64",
    ),
    Case("data_url_empty_payload", with_image("data:image/png;base64,"), 400, "empty"),
    Case(
        "data_url_svg",
        image_bytes(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"),
        400,
        "supported format",
    ),
    # --- truncated, corrupt, polyglot and refused formats
    Case("truncated_jpeg", image_bytes(encode(BASE, "JPEG")[:200], "image/jpeg"), 400, ""),
    Case(
        "png_bad_ihdr_crc", image_bytes(GOOD_PNG[:29] + bytes([GOOD_PNG[29] ^ 0xFF]) + GOOD_PNG[30:]), 400, ""
    ),
    Case("png_idat_cut_short", image_bytes(GOOD_PNG[:-40]), 400, "truncated"),
    Case(
        "polyglot_gif_javascript",
        image_bytes(b"GIF89a/*\x01\x00\x01\x00\x00\x00*/=1;alert(1)//", "image/gif"),
        400,
        "supported format",
    ),
    Case(
        "html_labelled_png", image_bytes(b"<html><script>alert(1)</script></html>"), 400, "supported format"
    ),
    Case("pdf_labelled_png", image_bytes(b"%PDF-1.4\n1 0 obj<<>>endobj\n"), 400, "supported format"),
    Case(
        "ico_not_an_allowed_format", image_bytes(encode(BASE, "ICO"), "image/x-icon"), 400, "supported format"
    ),
    Case("png_zero_width", image_bytes(png_header_only(0, 10)), 400, ""),
    # --- decompression bombs (by header; nothing is decoded)
    Case("png_bomb_81_megapixels_rgb", image_bytes(png_header_only(9000, 9000)), 400, "pixels"),
    Case(
        "jpeg_bomb_81_megapixels",
        image_bytes(jpeg_with_declared_size(9000, 9000), "image/jpeg"),
        400,
        "pixels",
    ),
    Case(
        "jpeg_bomb_3_6_gigapixels",
        image_bytes(jpeg_with_declared_size(60000, 60000), "image/jpeg"),
        400,
        "60000x60000",  # its few bytes of scan data are refused as truncated before its size
    ),
    Case("png_100000x1", image_bytes(encode(Image.new("L", (100_000, 1)), "PNG")), 400, "aspect ratio"),
    # --- counts and sizes. The image count is now checked before any image is loaded (each
    # of these nine URLs used to be fetched first).
    Case(
        "nine_images_none_fetched",
        lambda h: chat([{"type": "image_url", "image_url": {"url": f"{h.images.base}/img.png"}}] * 9),
        400,
        "at most 8 images",
        check=lambda h, hits_before: _assert_never_fetched(h, hits_before, "/img.png"),
    ),
    Case("prompt_fits_context_not_kv_cache", chat("hello " * (KV_BLOCKS * 16)), 400, "KV blocks"),
    # Token ids outside the vocabulary reached the embedding and failed the whole engine step
    # (every request batched with it); a 2**70 id was an OverflowError (500) in msgpack.
    Case(
        "completion_token_id_past_vocab",
        {"prompt": [10**6], "max_tokens": 2},
        400,
        "token ids",
        "/v1/completions",
    ),
    Case(
        "completion_negative_token_id",
        {"prompt": [1, -3], "max_tokens": 2},
        400,
        "token ids",
        "/v1/completions",
    ),
    Case(
        "completion_token_id_2_70", {"prompt": [2**70], "max_tokens": 2}, 400, "token ids", "/v1/completions"
    ),
    Case(
        "completion_1025_prompts",
        {"prompt": ["a"] * 1025, "max_tokens": 1},
        400,
        "at most 1024 prompts",
        "/v1/completions",
    ),
    # --- file:// against --allowed-local-media-path
    Case(
        "file_dotdot_escape",
        lambda h: with_image(f"file://{h.media}/../{h.outside.name}/secret.png"),
        400,
        "outside",
    ),
    Case(
        "file_dotdot_percent_encoded",
        lambda h: with_image(f"file://{h.media}/%2e%2e/{h.outside.name}/secret.png"),
        400,
        "outside",
    ),
    Case("file_symlink_to_outside", lambda h: with_image(f"file://{h.media}/link_out.png"), 400, "outside"),
    Case(
        "file_through_symlinked_dir",
        lambda h: with_image(f"file://{h.media}/link_etc/passwd"),
        400,
        "outside",
    ),
    Case("file_symlink_to_dev_zero", lambda h: with_image(f"file://{h.media}/link_dev"), 400, "outside"),
    Case("file_symlink_to_proc", lambda h: with_image(f"file://{h.media}/link_proc"), 400, "outside"),
    Case("file_proc_self_environ", with_image("file:///proc/self/environ"), 400, "outside"),
    Case(
        "file_proc_via_dotdot",
        lambda h: with_image(f"file://{h.media}/../../../../proc/self/cmdline"),
        400,
        "outside",
    ),
    Case("file_dev_urandom", with_image("file:///dev/urandom"), 400, "outside"),
    Case("bare_path_etc_shadow", with_image("/etc/shadow"), 400, "outside"),
    Case(
        "file_fifo_inside_root",
        lambda h: with_image(f"file://{h.media}/fifo.png"),
        400,
        "not a readable file",
    ),
    Case("file_directory", lambda h: with_image(f"file://{h.media}/sub"), 400, "not a readable file"),
    # ENAMETOOLONG escaped as an OSError: was a 500.
    Case(
        "file_name_too_long",
        lambda h: with_image(f"file://{h.media}/{'a' * 5000}.png"),
        400,
        "not a readable file",
    ),
    Case(
        "file_nul_byte", lambda h: with_image(f"file://{h.media}/ok.png%00.txt"), 400, "not a readable file"
    ),
    Case(
        "file_url_with_host",
        lambda h: with_image(f"file://attacker.example{h.media}/ok.png"),
        400,
        "must not name a host",
    ),
    # --- http(s): --allowed-media-domains 127.0.0.1 localhost
    Case("http_other_loopback_ip", with_image("http://127.0.0.2/x.png"), 400, "not in the allowed"),
    Case(
        "http_link_local_metadata",
        with_image("http://169.254.169.254/latest/meta-data/"),
        400,
        "not in the allowed",
    ),
    Case("http_private_10", with_image("http://10.0.0.1/x.png"), 400, "not in the allowed"),
    Case("http_private_192_168", with_image("https://192.168.1.1/x.png"), 400, "not in the allowed"),
    Case("http_ipv6_loopback", with_image("http://[::1]/x.png"), 400, "not in the allowed"),
    Case("http_ipv4_mapped_ipv6", with_image("http://[::ffff:127.0.0.1]/x.png"), 400, "not in the allowed"),
    Case("http_decimal_ip", with_image("http://2130706433/x.png"), 400, "not in the allowed"),
    Case(
        "http_localhost_resolves_to_loopback",
        lambda h: with_image(f"http://localhost:{h.images.port}/img.png"),
        400,
        "non-public",
    ),
    Case(
        "http_userinfo_trick",
        lambda h: with_image(f"http://127.0.0.1:{h.images.port}@169.254.169.254/"),
        400,
        "not in the allowed",
    ),
    Case(
        "redirect_to_metadata",
        lambda h: with_image(f"{h.images.base}/redirect?to=http://169.254.169.254/latest/"),
        400,
        "not in the allowed",
    ),
    Case(
        "redirect_to_localhost",
        lambda h: with_image(f"{h.images.base}/redirect?to=http://localhost:{h.images.port}/img.png"),
        400,
        "non-public",
    ),
    Case(
        "redirect_to_ipv6_loopback",
        lambda h: with_image(f"{h.images.base}/redirect?to=http://[::1]:{h.images.port}/img.png"),
        400,
        "not in the allowed",
    ),
    Case(
        "redirect_to_file_scheme",
        lambda h: with_image(f"{h.images.base}/redirect?to=file:///etc/passwd"),
        400,
        "unsupported scheme",
    ),
    Case("redirect_loop", lambda h: with_image(f"{h.images.base}/loop"), 400, "redirects"),
    Case("http_404", lambda h: with_image(f"{h.images.base}/missing"), 400, "HTTP 404"),
    # Sent with Content-Encoding: the bytes are read as sent, never inflated (64 MiB of zeros).
    Case(
        "http_deflate_bomb_not_inflated",
        lambda h: with_image(f"{h.images.base}/gzip"),
        400,
        "supported format",
    ),
    # --- roles and content parts
    Case("role_developer", {"messages": [{"role": "developer", "content": "hi"}]}, 400, "role"),
    Case("role_null", {"messages": [{"role": None, "content": "hi"}]}, 400, "role"),
    Case(
        "part_type_input_image", chat([{"type": "input_image", "image_url": GOOD_B64}]), 400, "not supported"
    ),
    Case("part_type_image_with_string", chat([{"type": "image", "image": "x.png"}]), 400, "not supported"),
    Case("part_without_type", chat([{"text": "hi"}]), 400, "not supported"),
    # The kwarg collided with an argument of our own call: was a 500 (TypeError).
    Case("chat_template_kwargs_messages", chat("hi", chat_template_kwargs={"messages": []}), 400, "messages"),
    # --- NaN / negative / huge sampling values (64-bit overflows were 500s in msgpack). NaN and
    # Infinity are not JSON (RFC 8259), nor is a number beyond a double: refused by the parser.
    Case("top_p_infinity", raw_chat_with('"top_p": Infinity'), 400, "not valid JSON"),
    Case("temperature_1e400", raw_chat_with('"temperature": 1e400'), 400, "not valid JSON"),
    Case("presence_penalty_nan", raw_chat_with('"presence_penalty": NaN'), 400, "not valid JSON"),
    Case("negative_top_k", chat("hi", top_k=-5), 400, "top_k"),
    Case("zero_repetition_penalty", chat("hi", repetition_penalty=0), 400, "repetition_penalty"),
    Case("min_p_above_one", chat("hi", min_p=1.5), 400, "min_p"),
    Case("max_tokens_zero", chat("hi", max_tokens=0), 400, "max_tokens"),
    Case("max_tokens_2_70", chat("hi", max_tokens=2**70), 400, "max_tokens"),
    Case("top_k_2_70", chat("hi", top_k=2**70), 400, "top_k"),
    Case("priority_2_70", chat("hi", priority=2**70), 400, "priority"),
    Case("stop_token_id_2_70", chat("hi", stop_token_ids=[2**70]), 400, "stop_token_ids"),
    Case("seed_2_70", chat("hi", seed=2**70), 400, "seed"),
    # n fanned out into n engine requests before any limit: n=10**6 wedged the server for minutes.
    Case("n_one_million", chat("hi", n=10**6), 400, "n"),
    Case("logprobs_without_flag", chat("hi", top_logprobs=3), 400, "top_logprobs"),
]


def _assert_never_fetched(h: Hardened, hits_before: dict, path: str) -> None:
    assert h.images.hits.get(path, 0) == hits_before.get(path, 0), "an image was fetched"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_request_gets_its_4xx_and_the_server_stays_correct(hardened, valid_answer, case: Case):
    hits_before = dict(hardened.images.hits)
    response = hardened.post(case.route, materialise(case.body, hardened))
    error = assert_openai_error(response, case.status, case.contains)
    assert len(error["message"]) < 1000, "error messages never echo megabytes of input"
    if case.check is not None:
        case.check(hardened, hits_before)
    assert_still_serving(hardened, valid_answer)


def test_the_corpus_is_large_and_new():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_body_over_the_limit_without_content_length_gets_413(hardened, valid_answer):
    """Chunked transfer: no Content-Length to check up front. Was a plain-text 500 (the limit
    raised inside the app, after Starlette had already answered)."""

    def chunks():
        yield b'{"messages": "'
        for _ in range(24):
            yield b"x" * 65536
        yield b'"}'

    response = hardened.post(CHAT, chunks())
    assert_openai_error(response, 413, "exceeds")
    assert_still_serving(hardened, valid_answer)


# ------------------------------------------------------------------------------ accepted images


def _frames(n: int, size=(40, 30)) -> list[Image.Image]:
    return [synthetic_image(*size, seed=i) for i in range(n)]


def _gif() -> bytes:
    first, *rest = _frames(3)
    return encode(first, "GIF", save_all=True, append_images=rest, duration=50, loop=0)


def _apng() -> bytes:
    first, *rest = _frames(3)
    return encode(first, "PNG", save_all=True, append_images=rest)


def _exif_rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° on display
    return encode(BASE, "JPEG", exif=exif)


def _gray16() -> bytes:
    return encode(Image.fromarray((np.arange(64 * 48).reshape(48, 64) * 20).astype(np.uint16)), "PNG")


# Unusual but valid: each must be answered with 200. (Animated images use their first frame.)
ACCEPTED = {
    "1x1": lambda: encode(Image.new("RGB", (1, 1), (255, 0, 0)), "PNG"),
    "200x1_at_the_aspect_limit": lambda: encode(Image.new("L", (200, 1)), "PNG"),
    "cmyk_jpeg": lambda: encode(BASE.convert("CMYK"), "JPEG"),
    "gray_16_bit_png": _gray16,
    "palette_png": lambda: encode(BASE.convert("P"), "PNG"),
    "palette_png_with_transparency": lambda: encode(BASE.convert("P"), "PNG", transparency=0),
    "gray_alpha_png": lambda: encode(BASE.convert("LA"), "PNG"),
    "rgba_png": lambda: encode(BASE.convert("RGBA"), "PNG"),
    "bilevel_png": lambda: encode(BASE.convert("1"), "PNG"),
    "animated_gif": _gif,
    "animated_png": _apng,
    "exif_rotated_jpeg": _exif_rotated_jpeg,
    "progressive_jpeg": lambda: encode(BASE, "JPEG", progressive=True),
    "webp": lambda: encode(BASE, "WEBP"),
    "tiff": lambda: encode(BASE, "TIFF"),
    "bmp": lambda: encode(BASE, "BMP"),
    "int32_tiff": lambda: encode(Image.fromarray(np.arange(64 * 48, dtype=np.int32).reshape(48, 64)), "TIFF"),
    "float32_tiff": lambda: encode(
        Image.fromarray(np.linspace(0, 1, 64 * 48, dtype=np.float32).reshape(48, 64)), "TIFF"
    ),
    # A PNG followed by a ZIP: only the PNG is read (documented as accepted).
    "png_zip_polyglot": lambda: GOOD_PNG + b"PK\x03\x04" + b"\0" * 64,
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_unusual_but_valid_image_is_accepted(hardened, name):
    body = image_bytes(ACCEPTED[name]())
    body["max_tokens"] = 1
    response = hardened.post(CHAT, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 4  # the image's tokens are in the prompt


@pytest.mark.parametrize(
    "name,url",
    [
        ("listed_ip_literal", "{base}/img.png"),
        ("redirect_within_the_listed_ip", "{base}/redirect?to=/img.png"),
        ("file_inside_root", "file://{media}/ok.png"),
        ("bare_absolute_path_inside_root", "{media}/ok.png"),
        ("symlink_inside_root", "file://{media}/link_in.png"),
        ("relative_symlink_back_into_root", "file://{media}/sub/up/ok.png"),
    ],
)
def test_allowed_sources_work(hardened, name, url):
    """Positive controls: the refusals above are about the address, not about fetching at all."""
    body = with_image(url.format(base=hardened.images.base, media=hardened.media))
    body["max_tokens"] = 1
    response = hardened.post(CHAT, body)
    assert response.status_code == 200, response.text


def test_animated_gif_uses_its_first_frame(hardened):
    """Same prompt tokens as the first frame alone (the pool hashes bytes, so both are computed)."""
    gif = Image.open(io.BytesIO(_gif()))
    first = next(iter(ImageSequence.Iterator(gif))).convert("RGB")
    tokens = []
    for data in (_gif(), encode(first, "PNG")):
        response = hardened.post("/tokenize", {"messages": image_bytes(data)["messages"]})
        assert response.status_code == 200, response.text
        tokens.append(response.json()["count"])
    assert tokens[0] == tokens[1]


def test_request_body_in_log_never_contains_image_data(hardened):
    """Even at debug level the server does not log request bodies (a data URL is client data)."""
    marker = base64.b64encode(b"do-not-log-me" * 4).decode()
    hardened.post(CHAT, chat([{"type": "text", "text": marker}]))
    assert marker not in hardened.server.log_path.read_text(errors="replace")

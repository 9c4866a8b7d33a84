"""The Files API through the real `openai` client: an uploaded image answers exactly as its data
URL does, a file is visible to the key that uploaded it only, quotas and expiry hold, bad
uploads get a clear 4xx and store nothing, and a deleted file is 404 wherever it is used."""

from __future__ import annotations

import base64
import struct
import time
import zlib

import numpy as np
import openai
import pytest
from PIL import Image

from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import ServerProcess

KEY_A, KEY_B = "sk-alice-0123456789", "sk-bob-9876543210"
MAX_FILES = 6


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    proc = ServerProcess(
        model_path,
        *("--preprocess-workers", "1", "--max-num-batched-tokens", "64", "--kv-cache-memory", "64MiB"),
        *("--api-key", f"{KEY_A},{KEY_B}", "--files-dir", str(folder / "store")),
        *("--files-max-count", str(MAX_FILES), "--max-file-size", "300KiB"),
        log_path=folder / "log",
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def alice(server):
    return client_for(server, KEY_A)


@pytest.fixture(scope="module")
def bob(server):
    return client_for(server, KEY_B)


def upload(client: openai.OpenAI, data: bytes, name: str = "picture.png", purpose: str = "vision"):
    return client.files.create(file=(name, data, "image/png"), purpose=purpose)


def ask(client: openai.OpenAI, image_part: dict) -> str:
    messages = [{"role": "user", "content": [image_part, {"type": "text", "text": "What is in it?"}]}]
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=10, temperature=0
    )
    return response.choices[0].message.content


def url_part(data: bytes) -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()},
    }


def image_file_part(file_id: str) -> dict:
    return {"type": "image_file", "image_file": {"file_id": file_id}}


def file_part(file_id: str) -> dict:
    return {"type": "file", "file": {"file_id": file_id}}


def png_announcing(width: int, height: int) -> bytes:
    """A PNG whose header claims width×height (a decompression bomb by its header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def test_an_uploaded_image_answers_exactly_as_its_data_url(alice):
    data = png_bytes(synthetic_image(200, 150, seed=31))
    stored = upload(alice, data)
    assert stored.id.startswith("file-") and len(stored.id) == len("file-") + 32
    assert (stored.bytes, stored.purpose, stored.filename) == (len(data), "vision", "picture.png")
    answers = {
        "first data URL": ask(alice, url_part(data)),
        "repeated data URL": ask(alice, url_part(data)),
        "image_file part": ask(alice, image_file_part(stored.id)),
        "file part": ask(alice, file_part(stored.id)),
    }
    assert len(set(answers.values())) == 1, answers


def test_list_retrieve_content_and_delete(alice):
    data = png_bytes(synthetic_image(64, 64, seed=34))
    stored = upload(alice, data, name="small.png")
    assert stored.id in [f.id for f in alice.files.list().data]
    assert alice.files.retrieve(stored.id).filename == "small.png"
    assert alice.files.content(stored.id).content == data
    assert alice.files.delete(stored.id).deleted
    for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(stored.id)
    with pytest.raises(openai.NotFoundError):
        ask(alice, image_file_part(stored.id))
    assert stored.id not in [f.id for f in alice.files.list().data]


def test_a_file_is_invisible_to_another_key(alice, bob):
    stored = upload(alice, png_bytes(synthetic_image(64, 48, seed=35)))
    assert stored.id not in [f.id for f in bob.files.list().data]
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(stored.id)
    for part in (image_file_part(stored.id), file_part(stored.id)):
        with pytest.raises(openai.NotFoundError):
            ask(bob, part)
    assert alice.files.retrieve(stored.id).id == stored.id  # Bob's delete did nothing
    alice.files.delete(stored.id)


def test_bad_uploads_get_a_clear_4xx_and_store_nothing(alice):
    before = len(alice.files.list().data)
    noise = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)
    too_big = png_bytes(Image.fromarray(noise))
    assert len(too_big) > 300 << 10
    cases = [
        (b"plain text, not an image", openai.BadRequestError, "not an image"),
        (png_announcing(30000, 30000), openai.BadRequestError, "pixels"),
        (png_bytes(synthetic_image(64, 64, seed=1))[:200], openai.BadRequestError, "not an image"),
        (too_big, openai.APIStatusError, "byte limit"),
    ]
    for data, error, words in cases:
        with pytest.raises(error, match=words) as caught:
            upload(alice, data)
        assert 400 <= caught.value.status_code < 500
    with pytest.raises(openai.APIStatusError) as caught:
        upload(alice, too_big)
    assert caught.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="purpose"):
        upload(alice, png_bytes(synthetic_image(32, 32, seed=2)), purpose="fine-tune")
    assert len(alice.files.list().data) == before


def test_the_file_count_quota_is_per_key(alice, bob):
    stored = [upload(bob, png_bytes(synthetic_image(32, 32, seed=40 + i))) for i in range(MAX_FILES)]
    with pytest.raises(openai.PermissionDeniedError, match="quota"):
        upload(bob, png_bytes(synthetic_image(32, 32, seed=99)))
    alice_file = upload(alice, png_bytes(synthetic_image(32, 32, seed=98)))  # Alice's quota is hers
    bob.files.delete(stored[0].id)
    upload(bob, png_bytes(synthetic_image(32, 32, seed=99)))  # the room came back
    alice.files.delete(alice_file.id)


def test_uploaded_files_expire(model_path, tmp_path):
    proc = ServerProcess(
        model_path, "--preprocess-workers", "0", "--files-ttl", "4", log_path=tmp_path / "log"
    )
    try:
        proc.wait_healthy()
        client = client_for(proc, "unused")
        stored = upload(client, png_bytes(synthetic_image(32, 32, seed=50)))
        assert stored.expires_at == stored.created_at + 4
        assert ask(client, image_file_part(stored.id))
        time.sleep(max(0.0, stored.expires_at - time.time()) + 0.2)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            ask(client, image_file_part(stored.id))
    finally:
        proc.stop()

"""Fixtures of the reliability tests.

`hardened` is one `mmserve serve` configured the way a careful operator would run it exposed
to untrusted clients: an API key, a 1 MiB body limit, a waiting-queue cap, a local media root
and an http allowlist, a tiny KV cache (24 blocks) and few sequences so overload is easy to reach,
priority scheduling (so the extreme priorities clients may send reach the scheduler; under fcfs
a priority is refused), and debug logging (to prove secrets stay out of logs even there). It is
shared by the hostile-input, auth, overload and fuzz tests; the fault tests kill processes and
start their own.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from reliability_util import (
    API_KEY,
    GOOD_PNG,
    KV_BLOCKS,
    MAX_NUM_SEQS,
    MAX_WAITING,
    VALID,
    Hardened,
    ImageHost,
    serve,
)

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint


@pytest.fixture(scope="session")
def model_path() -> Path:
    return checkpoint("qwen2_vl")


@pytest.fixture(scope="session")
def image_host():
    host = ImageHost(GOOD_PNG)
    yield host
    host.close()


@pytest.fixture(scope="session")
def hardened(model_path, image_host, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    outside = tmp_path_factory.mktemp("outside")
    _populate_media(media, outside)
    server = serve(
        model_path,
        "--preprocess-workers",
        "1",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--kv-cache-memory",
        f"{KV_BLOCKS * 32}KiB",
        "--max-num-batched-tokens",
        "256",
        "--max-waiting-requests",
        str(MAX_WAITING),
        "--scheduling-policy",
        "priority",
        "--max-request-body",
        "1MiB",
        "--allowed-local-media-path",
        str(media),
        "--allowed-media-domains",
        "127.0.0.1",
        "localhost",
        "--api-key",
        API_KEY,
        "--log-level",
        "debug",
        log_path=tmp_path_factory.mktemp("hardened") / "log",
    )
    try:
        server.wait_healthy(180)
        yield Hardened(server, media, outside, image_host, {"authorization": f"Bearer {API_KEY}"})
    finally:
        server.stop()


def _populate_media(media: Path, outside: Path) -> None:
    (media / "ok.png").write_bytes(GOOD_PNG)
    (outside / "secret.png").write_bytes(GOOD_PNG)
    (media / "sub").mkdir()
    links = {
        "link_in.png": media / "ok.png",
        "link_out.png": outside / "secret.png",
        "link_etc": Path("/etc"),
        "link_dev": Path("/dev/zero"),
        "link_proc": Path("/proc/self/environ"),
        "sub/up": Path(".."),  # relative: resolves back to the root itself
    }
    for name, target in links.items():
        os.symlink(target, media / name)
    os.mkfifo(media / "fifo.png")


@pytest.fixture(scope="session")
def offline_llm(model_path):
    """The offline engine (EngineCore in this process, a KV cache far larger than any test needs)
    that every served answer is compared with."""
    with LLM(model_path, num_kv_blocks=512) as llm:
        yield llm


@pytest.fixture(scope="session")
def greedy(offline_llm):
    """greedy(list of conversations, max_tokens, ignore_eos=False) → their texts, cached."""
    cache: dict = {}

    def run(conversations: list[list[dict]], max_tokens: int, ignore_eos: bool = False) -> list[str]:
        key = (repr(conversations), max_tokens, ignore_eos)
        if key not in cache:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            outputs = offline_llm.chat(conversations, params)
            cache[key] = [o.outputs[0].text for o in outputs]
        return cache[key]

    return run


@pytest.fixture(scope="session")
def valid_answer(greedy) -> str:
    return greedy([VALID["messages"]], VALID["max_tokens"])[0]

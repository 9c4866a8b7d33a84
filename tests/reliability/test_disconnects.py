"""A thousand clients that walk away at random points — before the request is read, during image
preprocessing, before the first token, mid-stream — leave nothing behind: no KV block, no
encoder-cache reference, no running or waiting request, no leaked socket, no traceback in the
log, and after the server stops, none of its shared-memory segments."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import random
import time
from pathlib import Path

import httpx
import pytest
from reliability_util import (
    fd_count,
    idle_gauges,
    large_png,
    segment_prefix,
    segments,
    serve,
    wait_for,
    with_text_chunk,
)

from mmserve.testing.server import descendants, is_alive

CHAT = "/v1/chat/completions"
NUM_REQUESTS = 1000
CONCURRENCY = 64


@pytest.fixture
def server(model_path, tmp_path):
    proc = serve(
        model_path,
        "--preprocess-workers",
        "2",
        "--max-num-seqs",
        "32",
        "--kv-cache-memory",
        "8MiB",
        "--max-num-batched-tokens",
        "512",
        log_path=tmp_path / "log",
    )
    try:
        proc.wait_healthy(180)
        yield proc
    finally:
        proc.stop()


def _text_body(i: int, stream: bool, max_tokens: int = 32) -> dict:
    return {
        "messages": [{"role": "user", "content": f"client {i} says hello"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _image_body(png: bytes, i: int, stream: bool) -> dict:
    url = "data:image/png;base64," + base64.b64encode(with_text_chunk(png, f"client {i}")).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 32, "stream": stream}


async def _client(c: httpx.AsyncClient, url: str, i: int, rng: random.Random, png: bytes) -> str:
    """One client that gives up somewhere; returns how it ended."""
    mode = rng.choice(["timeout_early", "preprocessing", "mid_stream", "mid_stream", "first_token", "finish"])
    try:
        if mode == "timeout_early":  # often before the server has read the body
            await c.post(url + CHAT, json=_text_body(i, False), timeout=rng.uniform(0.001, 0.03))
        elif mode == "preprocessing":  # a fresh large image: gone while the pool works on it
            body = _image_body(png, i, stream=rng.random() < 0.5)
            await c.post(url + CHAT, json=body, timeout=rng.uniform(0.01, 0.3))
        elif mode == "first_token":
            async with c.stream("POST", url + CHAT, json=_text_body(i, True), timeout=30) as r:
                await r.aiter_raw().__anext__()  # headers and the first bytes, then leave
        elif mode == "mid_stream":
            chunks = rng.randint(1, 8)
            async with c.stream("POST", url + CHAT, json=_text_body(i, True), timeout=30) as r:
                async for line in r.aiter_lines():
                    chunks -= line.startswith("data: {")
                    if chunks <= 0:
                        break
        else:
            r = await c.post(url + CHAT, json=_text_body(i, False, max_tokens=4), timeout=60)
            assert r.status_code == 200, r.text
            return "finished"
    except httpx.TimeoutException:
        return "timed_out"
    return "left"


async def _storm(url: str, png: bytes) -> dict[str, int]:
    rng = random.Random(0)
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as c:

        async def one(i: int) -> str:
            async with gate:
                return await _client(c, url, i, random.Random(rng.random()), png)

        results = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    counts: dict[str, int] = {}
    for result in results:
        counts[result] = counts.get(result, 0) + 1
    return counts


def _fds(pid: int, shm_prefix: str) -> tuple[int, int]:
    """(fds that are not this pool's shared-memory segments, fds that are)."""
    shm = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            shm += os.readlink(fd).startswith("/dev/shm/" + shm_prefix)
    return fd_count(pid) - shm, shm


def test_a_thousand_aborted_requests_leave_nothing_behind(server):
    png = large_png(640, 480)
    warm = httpx.post(server.url + CHAT, json=_image_body(png, -1, False), timeout=60)
    assert warm.status_code == 200, warm.text
    prefix = segment_prefix(server)
    children = descendants(server.proc.pid)
    fds_before = _fds(server.proc.pid, prefix)

    start = time.monotonic()
    counts = asyncio.run(_storm(server.url, png))
    elapsed = time.monotonic() - start
    print(f"{NUM_REQUESTS} clients in {elapsed:.1f} s: {counts}")
    assert sum(counts.values()) == NUM_REQUESTS
    assert counts.get("timed_out", 0) > 100 and counts.get("left", 0) > 300, counts

    assert wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 20), idle_gauges(server.url)
    # Cached images keep their segment mapped but hold no descriptor (issue 20, class 10);
    # everything else (sockets above all) must be back to before.
    settled = wait_for(lambda: _fds(server.proc.pid, prefix)[0] <= fds_before[0] + 2, 10)
    other, shm_fds = _fds(server.proc.pid, prefix)
    assert settled, f"fds leaked: {fds_before[0]} non-shm fds before, {other} after"
    assert shm_fds == 0, f"{shm_fds} descriptors of image segments are open"
    final = httpx.post(server.url + CHAT, json=_text_body(0, False, max_tokens=4), timeout=60)
    assert final.status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[log.find("Traceback") - 500 : log.find("Traceback") + 3000]

    assert server.stop() == 0  # SIGTERM drains and exits 0 (uvicorn alone re-raised it: -15)
    assert wait_for(lambda: not any(is_alive(p) for p in children), 5)
    assert segments(prefix) == [], "shared-memory segments outlived the server"

"""Resources and processes: dropped clients free everything; SIGTERM leaves nothing behind; a dead
EngineCore fails open requests, turns /health 503 and makes the server exit non-zero."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import ServerProcess, descendants, is_alive


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    )


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def long_chat(image_seed: int | None = None, max_tokens: int = 400) -> dict:
    content: list[dict] = [{"type": "text", "text": "Tell me everything."}]
    if image_seed is not None:
        url = (
            "data:image/png;base64,"
            + base64.b64encode(png_bytes(synthetic_image(200, 150, image_seed))).decode()
        )
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.7,
        "stream": True,
    }


def shm_segments(prefix: str) -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)}


def segment_prefix(server: ServerProcess) -> str:
    match = re.search(r"image segments (\S+)\*", server.log())
    assert match, server.log()
    return match.group(1)


def engine_pid(server: ServerProcess) -> int:
    match = re.search(r"EngineCore pid (\d+)", server.log())
    assert match, server.log()
    return int(match.group(1))


@pytest.fixture
def fresh_server(model_path, tmp_path):
    proc = ServerProcess(
        model_path, "--preprocess-workers", "2", "--kv-cache-memory", "32MiB", log_path=tmp_path / "log"
    )
    proc.wait_healthy()
    yield proc
    proc.stop()


def test_fifty_streams_dropped_midway_free_every_kv_block(fresh_server):
    url = fresh_server.url
    with httpx.Client(timeout=30) as client:
        for i in range(50):
            with client.stream(
                "POST", url + "/v1/chat/completions", json=long_chat(i % 5 if i % 2 else None)
            ) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                chunks = 0
                for line in lines:
                    if line.startswith("data: {"):
                        chunks += 1
                    if chunks >= 3:
                        break  # leaving the block closes the connection mid-stream
    assert wait_for(lambda: metric(url, "mmserve:kv_cache_blocks_in_use") == 0, 10), "KV blocks still held"
    assert metric(url, "mmserve:num_requests_running") == 0
    assert metric(url, "mmserve:num_requests_waiting") == 0
    assert metric(url, "mmserve:encoder_cache_references") == 0


def test_non_streaming_client_that_disconnects_is_aborted(fresh_server):
    url = fresh_server.url
    body = {**long_chat(max_tokens=3000), "stream": False}
    for _ in range(5):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.3)
    assert wait_for(lambda: metric(url, "mmserve:kv_cache_blocks_in_use") == 0, 10)
    assert metric(url, "mmserve:num_requests_running") == 0


@pytest.fixture
def make_server(model_path, tmp_path):
    """Servers a test starts and may kill itself; whatever is left is stopped afterwards."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(model_path, *args, log_path=tmp_path / f"log{len(started)}")
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


def test_sigterm_stops_every_child_within_five_seconds(make_server):
    # No grace for running requests: the drain has its own test (tests/reliability/test_drain.py).
    server = make_server("--preprocess-workers", "2", "--shutdown-timeout", "0")
    prefix = segment_prefix(server)
    children = descendants(server.proc.pid)
    assert len(children) >= 3  # EngineCore and two preprocess workers (plus multiprocessing helpers)

    # A request in flight while the signal arrives; it may be cut off, which is fine here.
    def in_flight() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(server.url + "/v1/chat/completions", json=long_chat(1), timeout=10)

    streaming = threading.Thread(target=in_flight, daemon=True)
    streaming.start()
    time.sleep(0.5)
    start = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    server.proc.wait(timeout=5)
    assert wait_for(lambda: not any(is_alive(p) for p in children), 5 - (time.monotonic() - start))
    assert not shm_segments(prefix)


def test_dead_engine_core_fails_requests_and_the_server_exits_nonzero(make_server):
    server = make_server("--preprocess-workers", "1")
    results: list = []

    def stream() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=long_chat(max_tokens=3000), timeout=20
        ) as r:
            results.append(r.status_code)
            results.append("".join(r.iter_lines()))

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(1.0)
    os.kill(engine_pid(server), signal.SIGKILL)
    assert wait_for(lambda: _health(server.url) in (503, None), 2)
    reader.join(10)
    assert results[0] == 200 and "error" in results[1] and results[1].endswith("data: [DONE]")
    assert server.proc.wait(timeout=5) != 0


def _health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.HTTPError:
        return None  # already gone

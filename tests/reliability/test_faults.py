"""Processes dying under load.

* A preprocess worker SIGKILLed mid-image: its image is retried on the new worker, so every
  request completes (was: the request whose image it held got a 500), and the pool replaces it.
* EngineCore SIGKILLed with streams open, non-streaming requests waiting and images in
  preprocessing: every request ends with an error, /health is 503 at once, the server exits
  non-zero within 5 s, and no child process or shared-memory segment outlives it.
(tests/e2e/test_lifecycle.py kills EngineCore under one stream; this is the loaded version.)
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from reliability_util import (
    engine_pid,
    idle_gauges,
    large_png,
    preprocess_worker_pids,
    segment_prefix,
    segments,
    serve,
    wait_for,
    with_text_chunk,
)

from mmserve.testing.server import descendants, is_alive

CHAT = "/v1/chat/completions"


@pytest.fixture
def server(model_path, tmp_path):
    proc = serve(model_path, "--preprocess-workers", "2", "--max-num-seqs", "32", log_path=tmp_path / "log")
    try:
        proc.wait_healthy(180)
        yield proc
    finally:
        proc.stop()


def _image_body(png: bytes, tag: str, **extra) -> dict:
    url = "data:image/png;base64," + base64.b64encode(with_text_chunk(png, tag)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def _text_body(i: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": f"text request {i}"}], "max_tokens": 4, **extra}


async def _timed_post(c: httpx.AsyncClient, url: str, body: dict) -> tuple[float, httpx.Response]:
    response = await c.post(url + CHAT, json=body)
    return time.monotonic(), response


def _warm_up(server) -> str:
    """One image through the pool (to learn its segment prefix) and one text request."""
    warm = httpx.post(server.url + CHAT, json=_image_body(large_png(64, 64), "warm"), timeout=60)
    assert warm.status_code == 200, warm.text
    return segment_prefix(server)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def _busy_worker(workers: set[int], timeout_s: float) -> int:
    """A worker that is decoding right now (it burns CPU), waiting for one up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = {pid: _cpu_ticks(pid) for pid in workers}
        await asyncio.sleep(0.2)
        busy = [pid for pid in workers if _cpu_ticks(pid) - before[pid] >= 5]  # >= 50 ms of 200
        if busy:
            return busy[0]
    raise AssertionError("no preprocess worker got busy")


def test_a_killed_preprocess_worker_costs_no_request_and_is_replaced(server):
    _warm_up(server)
    workers = preprocess_worker_pids(server)
    assert len(workers) == 2, workers
    big = large_png(3000, 2250)  # ~7 MP: long enough to decode that a worker is surely busy

    async def scenario() -> list[tuple[float, httpx.Response]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            bodies = [_image_body(big, f"k{i}") for i in range(8)] + [_text_body(i) for i in range(8)]
            tasks = [asyncio.create_task(_timed_post(c, server.url, b)) for b in bodies]
            victim = await _busy_worker(workers, timeout_s=30)
            os.kill(victim, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    assert all(r.status_code == 200 for _, r in results), [r.text for _, r in results if r.status_code != 200]
    log = server.log_path.read_text(errors="replace")
    assert "died with exit code -9 (SIGKILL) while processing image" in log
    assert "retrying it on a new worker" in log, "the killed worker held no image; nothing was tested"

    # Healed: two live workers (one new), and a new image goes through.
    assert wait_for(lambda: len(preprocess_worker_pids(server)) == 2, 30)
    assert preprocess_worker_pids(server) != workers
    after = httpx.post(server.url + CHAT, json=_image_body(big, "after"), timeout=120)
    assert after.status_code == 200, after.text
    assert wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 10)


class HealthWatcher:
    """Polls /health every 10 ms from a thread; records when (and how) it first stops being 200."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._first: tuple[float, int | None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self._url + "/health", timeout=0.5).status_code
            except httpx.TransportError:
                status = None
            if status != 200:
                self._first = (time.monotonic(), status)
                return
            time.sleep(0.01)

    def result(self, timeout_s: float) -> tuple[float, int | None]:
        self._thread.join(timeout_s)
        assert self._first is not None, "/health never stopped answering 200"
        return self._first


def test_a_killed_engine_core_ends_every_request_and_the_server(server):
    prefix = _warm_up(server)
    children = descendants(server.proc.pid)
    big = large_png(2400, 1800)
    long = {"max_tokens": 3000, "ignore_eos": True}
    outcomes: dict[str, tuple[float, int, str]] = {}

    async def stream(c: httpx.AsyncClient, name: str, started: asyncio.Event) -> None:
        async with c.stream("POST", server.url + CHAT, json=_text_body(0, stream=True, **long)) as r:
            text = ""
            async for line in r.aiter_lines():
                text += line + "\n"
                if line.startswith("data: {"):
                    started.set()
        outcomes[name] = (time.monotonic(), r.status_code, text)

    async def post(c: httpx.AsyncClient, name: str, body: dict) -> None:
        try:
            finished_at, r = await _timed_post(c, server.url, body)
            outcomes[name] = (finished_at, r.status_code, r.text)
        except httpx.TransportError as e:  # the server went away before answering
            outcomes[name] = (time.monotonic(), 0, type(e).__name__)

    async def scenario() -> tuple[float, float | None]:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as c:
            started = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(stream(c, f"stream{i}", started[i])) for i in range(6)]
            tasks += [asyncio.create_task(post(c, f"plain{i}", _text_body(i, **long))) for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            tasks += [asyncio.create_task(post(c, f"image{i}", _image_body(big, f"e{i}"))) for i in range(3)]
            await asyncio.sleep(0.3)
            watcher = HealthWatcher(server.url)  # its own thread: this loop is busy sending images
            os.kill(engine_pid(server), signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
            return killed_at, watcher.result(timeout_s=5)

    killed_at, (unhealthy_at, status) = asyncio.run(scenario())
    assert status in (503, None), status  # 503, or refused once the server is exiting
    assert unhealthy_at - killed_at < 1.0, f"/health was 200 {unhealthy_at - killed_at:.2f} s after"
    assert len(outcomes) == 13, outcomes.keys()
    for name, (finished_at, status, text) in outcomes.items():
        assert finished_at - killed_at < 5.0, (name, finished_at - killed_at)
        if name.startswith("stream"):
            ended_with_error = '"error"' in text and text.rstrip().endswith("data: [DONE]")
            assert status == 200 and ended_with_error, (name, text[-300:])
        else:  # an error body, or the connection closed as the server exited: never a 200
            assert status in (0, 500, 503), (name, status, text[:300])
    assert server.proc.wait(timeout=max(0.1, 5 - (time.monotonic() - killed_at))) != 0
    assert wait_for(lambda: not any(is_alive(p) for p in children), 5)
    assert segments(prefix) == [], "shared-memory segments outlived the server"

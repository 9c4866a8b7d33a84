"""Issue 20, class 3: no request stalls the event loop. While each heavy request runs, a probe
in another process asks /health every 20 ms; every answer must come within 100 ms.

Before: an 18 MB PNG of 1.5 M empty chunks and a 16 MB JPEG of 4 M comment markers blocked
/health 4-6 s (hashing and header parsing on the loop), a 28 MB body of 1 M empty messages
3-5 s (parsing), and a 58 MB answer (n=128, 20 top log-probabilities, 300 tokens) up to 12.6 s.
Now what grows with the request runs in threads (in pieces where it holds the GIL) and what
cannot move is bounded. The server runs with the default 64 MiB body limit.

The issue asks for this 100 ms bound, so it is asserted, on the probe's own clock.
"""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from reliability_util import serve

from mmserve.testing.hostile_images import jpeg_with_comments, png_with_empty_chunks
from mmserve.testing.reference import png_bytes

pytestmark = pytest.mark.heavy

HEALTH_BOUND_S = 0.1
PROBE_INTERVAL_S = 0.02
CHAT = "/v1/chat/completions"


def runqueue_wait_s(pid: int, tid: int) -> float:
    """Time thread `tid` of `pid` has spent runnable but not running (waiting for a CPU)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9


def probe(url: str, server_pid: int, ready, stop, results) -> None:
    """In a child process: GET /health every PROBE_INTERVAL_S until `stop`. Sends, per probe,
    (latency, latency not explained by waiting for a CPU, status): the time the server's event
    loop thread and this probe spent runnable but descheduled is the machine's load, not a
    stall of the loop (this shared machine runs other work; a stall holds the CPU or the GIL)."""
    samples = []
    me = os.getpid()
    with httpx.Client(timeout=5) as client:
        client.get(url + "/health")  # connected: the samples measure the server, not a handshake
        ready.set()
        while not stop.is_set():
            waited = runqueue_wait_s(server_pid, server_pid) + runqueue_wait_s(me, threading.get_native_id())
            start = time.perf_counter()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            latency = time.perf_counter() - start
            waited = (
                runqueue_wait_s(server_pid, server_pid)
                + runqueue_wait_s(me, threading.get_native_id())
                - waited
            )
            samples.append((latency, max(0.0, latency - waited), status))
            time.sleep(PROBE_INTERVAL_S)
    results.send(samples)


class HealthProbe:
    def __init__(self, url: str, server_pid: int) -> None:
        context = mp.get_context("spawn")
        self._ready = context.Event()
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(
            target=probe, args=(url, server_pid, self._ready, self._stop, send), daemon=True
        )

    def __enter__(self) -> HealthProbe:
        self._process.start()
        assert self._ready.wait(60), "the probe process did not start"
        time.sleep(0.1)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self.samples = self._receive.recv()
        self._process.join(10)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = serve(
        model_path, "--preprocess-workers", "1", log_path=tmp_path_factory.mktemp("watchdog") / "log"
    )
    try:
        proc.wait_healthy(180)
        yield proc
    finally:
        proc.stop()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_chat(data: bytes, media_type: str = "image/png", **extra) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(data, media_type)}},
        {"type": "text", "text": "?"},
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}


def text_chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, **extra}


def noise_png(width: int, height: int) -> bytes:
    """Incompressible: ~3 bytes per pixel on the wire."""
    from PIL import Image

    return png_bytes(Image.frombytes("RGB", (width, height), os.urandom(width * height * 3)))


def messages_body(count: int) -> bytes:
    return b'{"messages": [' + b",".join([b'{"role":"user","content":""}'] * count) + b"]}"


@dataclass(frozen=True)
class Heavy:
    id: str
    body: Callable[[], dict | bytes]
    status: int
    stream: bool = False


HEAVY = [
    Heavy("png_18mb_of_1_5m_empty_chunks", lambda: image_chat(png_with_empty_chunks(1_500_000)), 400),
    Heavy("jpeg_16mb_of_4m_comments", lambda: image_chat(jpeg_with_comments(4_000_000), "image/jpeg"), 400),
    Heavy("body_28mb_of_1m_empty_messages", lambda: messages_body(1_000_000), 400),
    Heavy("body_of_600k_values", lambda: {**text_chat("hi"), "stop_token_ids": [0] * 600_000}, 400),
    Heavy(
        "answer_n128_top20_300_tokens",
        lambda: text_chat("hi", n=128, logprobs=True, top_logprobs=20, max_tokens=300),
        400,
    ),
    Heavy(
        "answer_7mb_of_logprobs",
        lambda: text_chat("hi", n=16, logprobs=True, top_logprobs=20, max_tokens=300),
        200,
    ),
    Heavy(
        "stream_n64_top20",
        lambda: text_chat("hi", n=64, logprobs=True, top_logprobs=20, max_tokens=100, stream=True),
        200,
        stream=True,
    ),
    Heavy("valid_12mb_noise_png", lambda: image_chat(noise_png(2000, 2000)), 200),
    Heavy("text_just_under_the_length_precheck", lambda: text_chat("hello " * 43_000), 400),
]


def send(url: str, heavy: Heavy, body: dict | bytes) -> int:
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=300) as client:
        if heavy.stream:
            with client.stream("POST", url + CHAT, json=body) as r:
                for _ in r.iter_lines():
                    pass
                return r.status_code
        if isinstance(body, bytes):
            return client.post(url + CHAT, content=body, headers=headers).status_code
        return client.post(url + CHAT, json=body).status_code


@pytest.mark.parametrize("heavy", HEAVY, ids=[h.id for h in HEAVY])
def test_health_answers_within_100_ms_while_a_heavy_request_runs(server, heavy: Heavy):
    body = heavy.body()
    with HealthProbe(server.url, server.proc.pid) as watch:
        status = send(server.url, heavy, body)
        time.sleep(0.2)
    assert status == heavy.status
    assert all(health == 200 for *_, health in watch.samples) and len(watch.samples) >= 5, watch.samples[:5]
    latencies = sorted(latency for latency, _, _ in watch.samples)
    stalls = sorted(stall for _, stall, _ in watch.samples)
    report = (
        f"{len(latencies)} probes: /health median {latencies[len(latencies) // 2] * 1000:.1f} ms, "
        f"slowest {latencies[-1] * 1000:.1f} ms; less CPU waits: slowest {stalls[-1] * 1000:.1f} ms"
    )
    print(f"{heavy.id}: {report}")
    assert stalls[-1] < HEALTH_BOUND_S, report

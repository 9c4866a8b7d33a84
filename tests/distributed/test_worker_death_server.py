"""A tensor-parallel server whose worker process is killed: the engine reports dead within 5 s,
the open stream ends with an error, /health turns 503, the server exits non-zero, and no process
of it is left."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.server import ServerProcess, descendants, is_alive

pytestmark = pytest.mark.timeout(180)


def worker_pids(server: ServerProcess) -> list[int]:
    """The processes the EngineCore process spawned for the ranks (not multiprocessing's helpers)."""
    engine = int(re.search(r"EngineCore pid (\d+)", server.log()).group(1))
    found = []
    for pid in descendants(engine):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found.append(pid)
    return found


def health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=1).status_code
    except httpx.HTTPError:
        return None  # already gone


def test_killed_worker_fails_the_stream_and_the_server_exits_nonzero(tmp_path):
    server = ServerProcess(checkpoint("qwen2_vl"), "-tp", "2", "--preprocess-workers", "0", log_path=tmp_path / "log")
    try:
        server.wait_healthy()
        everything = descendants(server.proc.pid)
        workers = worker_pids(server)
        assert len(workers) == 2, server.log()
        results: list = []

        def stream() -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "Tell me everything."}],
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=20) as r:
                results.append(r.status_code)
                results.append("".join(r.iter_lines()))

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(1.0)
        os.kill(workers[1], signal.SIGKILL)
        start = time.monotonic()
        while health(server.url) == 200 and time.monotonic() - start < 10:
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        reader.join(10)
        assert elapsed < 5, "the issue's contract: dead reported within 5 s"
        assert results[0] == 200 and "error" in results[1] and results[1].endswith("data: [DONE]")
        assert server.proc.wait(timeout=10) != 0
        assert not any(is_alive(pid) for pid in everything)
    finally:
        server.stop()

"""Issue 20, class 9: SIGTERM with streams open drains instead of cutting them.

Was: 8 open streams were cut mid-body (no error event, no [DONE]), the log filled with
CancelledError tracebacks, and the process died by the signal. Now the server stops accepting,
running requests get `--shutdown-timeout` seconds, the rest end with an error (streams: an
error event, then [DONE]), and the process exits with status 0 leaving nothing behind.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal

import httpx
import pytest
from reliability_util import GOOD_PNG, segment_prefix, segments, serve, wait_for

from mmserve.testing.server import descendants, is_alive

CHAT = "/v1/chat/completions"
GRACE_S = 4
SHORT_TOKENS = 30  # at most ~130 ms a step to finish within the grace; 3000 cannot


@pytest.fixture
def server(model_path, tmp_path):
    proc = serve(
        model_path,
        "--preprocess-workers",
        "1",
        "--max-num-seqs",
        "16",
        "--shutdown-timeout",
        str(GRACE_S),
        log_path=tmp_path / "log",
    )
    try:
        proc.wait_healthy(180)
        yield proc
    finally:
        proc.stop()


def body(max_tokens: int, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_sigterm_lets_short_requests_finish_ends_the_rest_cleanly_and_exits_zero(server):
    image = "data:image/png;base64," + base64.b64encode(GOOD_PNG).decode()
    warm = httpx.post(
        server.url + CHAT,
        json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}],
            "max_tokens": 2,
        },
        timeout=60,
    )
    assert warm.status_code == 200, warm.text
    prefix = segment_prefix(server)
    children = descendants(server.proc.pid)
    streams: dict[str, list[str]] = {}
    plain: dict[str, httpx.Response] = {}
    killed = asyncio.Event()
    finished_after_kill: set[str] = set()

    async def stream(c: httpx.AsyncClient, name: str, max_tokens: int, started: asyncio.Event) -> None:
        lines: list[str] = []
        streams[name] = lines
        async with c.stream("POST", server.url + CHAT, json=body(max_tokens, True)) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
                    if killed.is_set() and '"finish_reason":"length"' in line.replace(" ", ""):
                        finished_after_kill.add(name)

    async def post(c: httpx.AsyncClient, name: str) -> None:
        plain[name] = await c.post(server.url + CHAT, json=body(3000, False))

    async def scenario() -> bool:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as c:
            started = [asyncio.Event() for _ in range(8)]
            plan = [("short", SHORT_TOKENS)] * 4 + [("long", 3000)] * 4
            tasks = [
                asyncio.create_task(stream(c, f"{kind}{i}", tokens, started[i]))
                for i, (kind, tokens) in enumerate(plan)
            ]
            tasks += [asyncio.create_task(post(c, f"plain{i}")) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            os.kill(server.proc.pid, signal.SIGTERM)
            killed.set()
            await asyncio.sleep(0.5)
            try:  # no new connection is accepted while draining
                await httpx.AsyncClient().get(server.url + "/health", timeout=2)
                refused = False
            except httpx.TransportError:
                refused = True
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return refused

    refused = asyncio.run(scenario())
    assert refused, "a new connection was accepted during the drain"
    assert finished_after_kill & {f"short{i}" for i in range(4)}, "no request finished in the grace period"
    for name, lines in streams.items():
        assert lines and lines[-1] == "[DONE]", (name, lines[-3:])
        events = [json.loads(line) for line in lines[:-1]]
        errors = [event["error"] for event in events if "error" in event]
        finishes = [
            choice["finish_reason"]
            for e in events
            for choice in e.get("choices", [])
            if choice["finish_reason"]
        ]
        if errors:  # ended by the deadline: one error event, right before [DONE]
            assert len(errors) == 1 and "error" in events[-1], (name, events[-2:])
            assert errors[0]["type"] == "service_unavailable" and "shutting down" in errors[0]["message"]
        else:  # finished within the grace period, with all its text
            assert finishes == ["length"], (name, events[-2:])
        if name.startswith("long"):
            assert errors, f"{name} cannot have generated 3000 tokens in {GRACE_S} s"
    for name, response in plain.items():
        assert response.status_code == 503, (name, response.text[:300])
        assert "shutting down" in response.json()["error"]["message"]
    assert server.proc.wait(timeout=30) == 0
    assert wait_for(lambda: not any(is_alive(p) for p in children), 10)
    assert segments(prefix) == []
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]

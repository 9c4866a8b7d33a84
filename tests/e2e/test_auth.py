"""With --api-key, every route that reaches the model wants the key; /health does not."""

from __future__ import annotations

import httpx
import pytest

from mmserve.testing.server import ServerProcess

KEY = "sk-test-0123456789abcdef"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(
        model_path,
        "--preprocess-workers",
        "0",
        "--api-key",
        KEY,
        log_path=tmp_path_factory.mktemp("auth") / "log",
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "method,route,body",
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
    ],
)
@pytest.mark.parametrize("header", [None, "Bearer wrong-key", f"Bearer {KEY}x", KEY, "Basic abc"])
def test_routes_refuse_a_missing_or_wrong_key(server, method, route, body, header):
    headers = {"authorization": header} if header else {}
    response = httpx.request(method, server.url + route, json=body, headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_the_right_key_is_accepted_and_health_needs_none(server):
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_key_never_appears_in_the_log(server):
    httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"})
    assert KEY not in server.log()

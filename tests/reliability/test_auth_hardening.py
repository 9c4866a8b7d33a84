"""--api-key, beyond tests/e2e/test_auth.py (which checks five routes × five bad headers):
every route in the OpenAPI schema is covered, path spellings cannot route around the check,
the comparison is constant-time, public pages stay public, and the key stays out of logs and
responses even at debug level."""

from __future__ import annotations

import ast
import inspect
import re

import httpx
import pytest
from reliability_util import API_KEY, assert_openai_error

from mmserve.entrypoints.openai import middleware

PUBLIC = {"/health", "/metrics"}  # /metrics: engine counters, no model access (as in vLLM)
CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def _call(url: str, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    body = CHAT_BODY if method == "POST" else None
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=30)


def test_every_route_in_the_schema_except_health_and_metrics_wants_the_key(hardened):
    """Enumerated from the live schema, so a route added later is covered without editing this."""
    schema = httpx.get(hardened.url + "/openapi.json", timeout=10).json()
    routes = [(m.upper(), p) for p, ops in schema["paths"].items() for m in ops if p not in PUBLIC]
    assert {p for _, p in routes} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"}
    for method, path in routes:
        for headers in ({}, {"authorization": "Bearer " + API_KEY[:-1]}):
            assert_openai_error(_call(hardened.url, method, path, headers), 401, "API key")


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/",  # trailing slash
        "//v1/chat/completions",  # doubled slash
        "/v1//chat/completions",
        "/V1/chat/completions",  # case
        "/v1/../v1/chat/completions",  # dot segments are not normalised by the server
        "/%76%31/chat/completions",  # percent-encoded "v1"
        "/v1/chat/completions%2f",
        "/v1/chat/completions?api_key=sk-in-the-query-string",  # query strings are not credentials
        "/tokenize/",
        "/detokenize/",
    ],
)
def test_no_path_spelling_reaches_the_model_without_the_key(hardened, path):
    response = httpx.post(hardened.url + path, json=CHAT_BODY, timeout=30, follow_redirects=True)
    assert response.status_code in (401, 404, 405), (response.status_code, response.text[:200])
    assert "choices" not in response.text and "tokens" not in response.text


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": f"Bearer  {API_KEY}"},  # two spaces
        {"authorization": f"Bearer {API_KEY}x"},
        {"authorization": f"Token {API_KEY}"},
        {"x-api-key": API_KEY},
        {"api-key": API_KEY},
        {"authorization": "Bearer " + API_KEY.upper()},
        {"authorization": b"Bearer \xe9\xe9\xff"},  # not ASCII
        {"authorization": "Bearer " + API_KEY * 200},  # long
    ],
    ids=lambda h: repr(h)[:30],
)
def test_near_miss_credentials_are_refused(hardened, headers):
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
        assert_openai_error(_call(hardened.url, method, path, headers), 401)


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS", "PUT", "DELETE"])
def test_other_methods_on_model_routes_are_refused_without_the_key(hardened, method):
    response = httpx.request(method, hardened.url + "/v1/models", timeout=30)
    assert response.status_code in (401, 405), response.status_code


def test_health_chat_page_and_static_files_need_no_key(hardened):
    assert httpx.get(hardened.url + "/health", timeout=10).status_code == 200
    page = httpx.get(hardened.url + "/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    scripts = re.findall(r'src="(/static/[^"]+)"', page.text)
    for script in scripts[:3]:
        assert httpx.get(hardened.url + script, timeout=10).status_code == 200, script


def test_the_key_is_compared_in_constant_time():
    """The auth middleware compares with hmac.compare_digest, and nothing compares the key with ==."""
    source = inspect.getsource(middleware)
    tree = ast.parse(source)
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "compare_digest"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "hmac"
    ]
    assert calls, "the API key must be checked with hmac.compare_digest"
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            text = ast.get_source_segment(source, node) or ""
            assert "api_key" not in text, f"non-constant-time comparison: {text}"


def test_the_key_never_reaches_logs_or_responses_even_at_debug_level(hardened):
    """The server runs with --log-level debug. Right, wrong and near-miss keys are all sent."""
    near_miss = API_KEY + "x"
    bodies = []
    for header in (f"Bearer {API_KEY}", f"Bearer {near_miss}", f"Bearer {API_KEY[:8]}", API_KEY):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
            response = _call(hardened.url, method, path, {"authorization": header})
            bodies.append(response.text)
    assert not any(API_KEY in b or API_KEY[:8] in b for b in bodies)
    log = hardened.server.log_path.read_text(errors="replace")
    assert "DEBUG" in log, "the server is expected to log at debug level"
    assert API_KEY not in log and near_miss not in log and API_KEY[:12] not in log

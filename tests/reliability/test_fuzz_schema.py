"""Schema-driven fuzzing (schemathesis) of the model routes: bodies that follow the published
request schema (positive) and bodies that break it (negative) never get a 5xx, every 4xx is an
OpenAI error body, and the server is still exact afterwards.

The routes parse raw JSON themselves, so their request schemas are published through
`openapi_extra` (routes.py); without them schemathesis would send no body at all.
Generated answers are capped at 2 tokens and n at 2 (the schema allows up to 2**63 tokens and
n=128): the fuzz is about parsing and validation, not about waiting for long answers.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from reliability_util import assert_still_serving

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = {  # per route and mode (positive, negative): ~150 requests per mode
    ("POST", "/v1/chat/completions"): 50,
    ("POST", "/v1/completions"): 50,
    ("POST", "/tokenize"): 25,
    ("POST", "/detokenize"): 25,
    ("GET", "/v1/models"): 5,
}
GENERATING = {"/v1/chat/completions", "/v1/completions"}


def _operations(hardened):
    raw = httpx.get(hardened.url + "/openapi.json", timeout=10).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        body = raw["paths"][path]["post"].get("requestBody")
        assert body and body["content"]["application/json"]["schema"]["properties"], path
    schema = schemathesis.openapi.from_dict(raw)
    for result in schema.get_all_operations():
        operation = result.ok()
        key = (operation.method.upper(), operation.path)
        if key in EXAMPLES:
            yield key, operation


def _bounded(case, path: str) -> None:
    """Keep generated work small: at most 2 tokens and 2 choices (only where the value is an
    int above that, so schema-breaking values are left as generated)."""
    body = case.body
    if path not in GENERATING or not isinstance(body, dict):
        return
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    for name, cap in (("max_tokens", 2), ("max_completion_tokens", 2), ("n", 2), ("min_tokens", 2)):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap


def _check(response, case) -> None:
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    content_type = response.headers.get("content-type") or [""]  # schemathesis: lists of values
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    is_json = content_type.startswith("application/json")
    if response.status_code >= 400 and is_json:
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text


def _fuzz(hardened, operation, generation_mode, examples: int, statuses: dict[int, int]) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=generation_mode))
    def fuzz(case):
        _bounded(case, operation.path)
        response = case.call(base_url=hardened.url, headers=hardened.headers, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        _check(response, case)

    fuzz()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzzing_never_gets_a_server_error(hardened, valid_answer, mode):
    generation_mode = schemathesis.GenerationMode(mode)
    counts: dict[tuple[str, str], dict[int, int]] = {}
    for key, operation in _operations(hardened):
        if mode == "negative" and key[0] == "GET":
            continue  # nothing to break: no body, no parameters
        _fuzz(hardened, operation, generation_mode, EXAMPLES[key], counts.setdefault(key, {}))
    print(mode, counts)
    assert sum(sum(s.values()) for s in counts.values()) >= 125
    if mode == "positive":  # schema-valid bodies must also get served, not just refused
        assert counts[("POST", "/v1/chat/completions")].get(200, 0) > 0, counts
    assert_still_serving(hardened, valid_answer)

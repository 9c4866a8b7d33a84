"""A server-sent event carries the chunk as JSON that parses back to the chunk itself."""

from __future__ import annotations

import json

from mmserve.entrypoints.openai.generation import sse


def test_an_event_parses_back_to_its_chunk():
    chunk = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": {"content": 'é \u2028 "quoted" \\ ✓'}, "finish_reason": None}],
        "logprobs": {"content": [{"token": "a", "logprob": -0.1 - 0.2, "bytes": [97]}]},
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    event = sse(chunk)
    assert event.startswith("data: {") and event.endswith("\n\n")
    assert json.loads(event[len("data: ") :]) == chunk
    assert sse("[DONE]") == "data: [DONE]\n\n"

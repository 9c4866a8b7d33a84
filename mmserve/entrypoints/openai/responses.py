"""JSON answers that may be large, serialised without stalling the event loop.

`json.dumps` is one C call holding the GIL: a 58 MB answer (n=128 choices with 20 top
log-probabilities each) kept every other request and /health waiting about a second. Here the
answer is serialised in a thread, in pieces (the response's outer structure one value at a
time, the long lists inside it `_PIECE` items at a time), so the loop gets the GIL back in
between. The bytes equal Starlette's `JSONResponse` rendering.

Freeing such an answer is as costly: dropping the last reference to 10^5 nested objects frees
them all in one step that holds the GIL (a 7 MB answer with log-probabilities stalled /health
~0.15 s when its objects were dropped on the loop). So `answer_bytes` builds, renders and then
takes apart the answer — and the engine outputs it was built from — a piece at a time in the
same thread, and hands the loop only bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mmserve.outputs import RequestOutput

_PIECE = 64  # list items per json.dumps call (a few hundred microseconds each)
_SPINE_DEPTH = 4  # body → choices → choice → logprobs → content: big lists are this deep
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def answer_bytes(build: Callable[[list[RequestOutput]], dict], owned: list[list[RequestOutput]]) -> bytes:
    """In a thread: the JSON bytes of `build(outputs)`, where `outputs` is taken out of `owned`
    (so this thread holds their last reference), then both freed a piece at a time."""
    outputs = owned.pop()
    body = build(outputs)
    rendered = render_json(body)
    free_in_pieces(body)
    for output in outputs:
        free_in_pieces(output.prompt_logprobs)
        for completion in output.outputs:
            free_in_pieces(completion.logprobs)
    return rendered


def render_json(value: object) -> bytes:
    """`JSONResponse(value).body`, made of many short `json.dumps` calls."""
    parts: list[str] = []
    _render(value, parts, _SPINE_DEPTH)
    return "".join(parts).encode("utf-8")


def _render(value: object, parts: list[str], depth: int) -> None:
    """Walk dicts and lists down to `depth`, each value on its own; at that depth a list is
    encoded `_PIECE` items at a time, anything else in one call."""
    if depth > 0 and isinstance(value, dict) and all(isinstance(key, str) for key in value):
        parts.append("{")
        for index, (key, item) in enumerate(value.items()):
            parts.append(("," if index else "") + _encode(key) + ":")
            _render(item, parts, depth - 1)
        parts.append("}")
    elif depth > 0 and isinstance(value, list | tuple):
        parts.append("[")
        for index, item in enumerate(value):
            if index:
                parts.append(",")
            _render(item, parts, depth - 1)
        parts.append("]")
    elif isinstance(value, list | tuple) and len(value) > _PIECE:
        pieces = (
            _encode(list(value[start : start + _PIECE]))[1:-1] for start in range(0, len(value), _PIECE)
        )
        parts.append("[" + ",".join(pieces) + "]")
    else:
        parts.append(_encode(value))


def free_in_pieces(value: Any, depth: int = _SPINE_DEPTH) -> None:
    """Empty `value`'s dicts and lists down to `depth`, and the lists at that depth `_PIECE`
    items at a time, so that no single step frees more than a few thousand objects."""
    if isinstance(value, dict):
        for key in list(value):
            if depth > 0:
                free_in_pieces(value[key], depth - 1)
            del value[key]
    elif isinstance(value, list):
        while value:
            if depth > 0:
                free_in_pieces(value[-1], depth - 1)
                value.pop()
            else:
                del value[-_PIECE:]

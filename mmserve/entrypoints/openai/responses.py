"""JSON answers that may be large, serialised without stalling the event loop.

`json.dumps` is one C call holding the GIL: a 58 MB answer (n=128 choices with 20 top
log-probabilities each) kept every other request and /health waiting about a second. Here the
answer is serialised in a thread, in pieces (the response's outer structure one value at a
time, the long lists inside it `_PIECE` items at a time), so the loop gets the GIL back in
between. The bytes equal Starlette's `JSONResponse` rendering.
"""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import Response

_PIECE = 64  # list items per json.dumps call (a few hundred microseconds each)
_SPINE_DEPTH = 4  # body → choices → choice → logprobs → content: big lists are this deep
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


async def json_response(content: object, status_code: int = 200) -> Response:
    body = await asyncio.to_thread(render_json, content)
    return Response(body, status_code=status_code, media_type="application/json")


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

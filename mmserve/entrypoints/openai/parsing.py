"""Request bodies: read and validate JSON (`parse_body`), and publish its schema (`json_body`).

The routes parse their own JSON rather than letting FastAPI do it, so every malformed body
(bad JSON, bad UTF-8, a lone surrogate, a huge integer, a wrong type, a body not sent as JSON)
is an OpenAI-style 4xx that names the problem, never a 422 or a 500.

A parser holds the GIL whatever thread runs it, so parsing must stay cheap: a large body is
handled in a thread, its long strings (images as data URLs) are cut out before parsing (see
long_strings.py), and the number of JSON containers and values — what the parse cost grows
with — is counted first and bounded (1 M empty messages, 28 MB, took `json` ~1 s). msgspec
parses what is left, 2-5 times faster than `json`.
"""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from mmserve.entrypoints.openai import long_strings
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request

Body = TypeVar("Body", bound=BaseModel)

MAX_JSON_CONTAINERS = 1 << 14  # objects and arrays in one body
MAX_JSON_SEPARATORS = 1 << 17  # commas: about the number of values
_INLINE_BYTES = 1 << 20  # smaller bodies are parsed on the loop (a thread hop costs more)
_COUNT_PIECE = 1 << 20

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def parse_body(raw: Request, model: type[Body]) -> Body:
    _check_content_type(raw)
    data = await read_body(raw)
    body = decode_json(data) if len(data) <= _INLINE_BYTES else await asyncio.to_thread(decode_json, data)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        location = [part for part in (errors[0].get("loc", ()) if errors else ()) if part != "body"]
        field = str(location[0]) if location else None  # the top-level field, as the 400's param
        raise bad_request(describe_validation(errors), field) from None


async def read_body(raw: Request) -> bytearray:
    """The body, received into one growing buffer (no join of megabytes at the end; large
    buffers grow by remapping, not copying). BodySizeLimit has bounded it already."""
    body = bytearray()
    try:
        async for chunk in raw.stream():
            body += chunk
    except ClientDisconnect:
        raise OpenAIError(499, "client disconnected") from None
    return body


def _check_content_type(raw: Request) -> None:
    """Only `application/json`: a browser sends a cross-site `text/plain` or form POST without
    asking first (no CORS preflight), so accepting those would let any web page use the API."""
    media_type = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = media_type[:64] or "none"
        raise OpenAIError(415, f"send the body as JSON with Content-Type: application/json (got {shown})")


def decode_json(data: bytes | bytearray) -> object:
    """The JSON value of `data` (RFC 8259: no NaN or Infinity), after bounding its size in
    containers and values; long data URLs come back as `RawDataUrl`s."""
    cut = long_strings.cut(data) if len(data) >= long_strings.MIN_BYTES else long_strings.Cut(data, [], "")
    document = cut.document
    containers = _count(document, b"{") + _count(document, b"[")  # inside strings too: an overestimate
    if containers > MAX_JSON_CONTAINERS:
        raise bad_request(f"the request body has more than {MAX_JSON_CONTAINERS:,} JSON objects and arrays")
    if _count(document, b",") > MAX_JSON_SEPARATORS:
        raise bad_request(f"the request body has more than {MAX_JSON_SEPARATORS:,} JSON values")
    try:
        return cut.restore(msgspec.json.decode(document))
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # bad UTF-8, NaN, 1e400 ...
        if _SURROGATE_ESCAPE.search(document):  # valid pairs decode; a lone one does not
            raise bad_request(
                "the request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff)"
            ) from None
        raise bad_request("the request body is not valid JSON") from None


def _count(data: bytes | bytearray, byte: bytes) -> int:
    """`data.count(byte)`, a megabyte at a time (each call holds the GIL)."""
    return sum(data.count(byte, start, start + _COUNT_PIECE) for start in range(0, len(data), _COUNT_PIECE))


def describe_validation(errors: list) -> str:
    """The first validation error as one sentence naming its field."""
    first = errors[0] if errors else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    return f"invalid value for {where or 'the request'}: {first.get('msg', 'invalid')}"


def json_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its own JSON (see `parse_body`): the
    model's JSON schema with its `$defs` inlined, so clients and fuzzers see what is accepted."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}

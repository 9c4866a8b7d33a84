"""Request bodies: read and validate JSON (`parse_body`), and publish its schema (`json_body`).

The routes parse their own JSON rather than letting FastAPI do it, so every malformed body
(bad JSON, bad UTF-8, a lone surrogate, a huge integer, a wrong type) is an OpenAI-style 400
that names the offending field, never a 422 or a 500.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from mmserve.entrypoints.openai.errors import OpenAIError, bad_request

Body = TypeVar("Body", bound=BaseModel)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def parse_body(raw: Request, model: type[Body]) -> Body:
    try:
        data = await raw.body()
    except ClientDisconnect:
        raise OpenAIError(499, "client disconnected") from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # also bad UTF-8 and integers over 4300 digits
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(data) and not _is_valid_unicode(body):
        # json.loads keeps a lone surrogate escape as is; no encoder downstream accepts it.
        raise bad_request("the request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff)")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        location = [part for part in (errors[0].get("loc", ()) if errors else ()) if part != "body"]
        field = str(location[0]) if location else None  # the top-level field, as the 400's param
        raise bad_request(describe_validation(errors), field) from None


def _is_valid_unicode(body: dict) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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

"""ASGI middleware of the API server: the request body size limit, API-key authentication, and
browser safety (the Host names served and the origins allowed).

All are plain ASGI (not Starlette's BaseHTTPMiddleware), so they pass the request's `receive`
through untouched: a handler still sees its client disconnect (see `disconnect.py`).
"""

from __future__ import annotations

import hmac
import json
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.entrypoints.openai.errors import OpenAIError, error_body


class BodySizeLimit:
    """413 for a body over the limit, by header or as it streams in.

    A body that outgrows the limit while streaming (no Content-Length, e.g. chunked) is answered
    here, and the app then sees the client as gone: it never gets the rest, and anything it
    would still send is dropped, so exactly one response goes out.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_json(send, 413, self._too_large())
        seen = 0
        started = False  # the app began its response (then it is too late to send a 413)
        rejected = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    rejected = True
                    if not started:
                        await _send_json(send, 413, self._too_large())
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    def _too_large(self) -> dict:
        return error_body(413, f"request body exceeds {self.max_bytes} bytes")


class ApiKeyAuth:
    """401 unless a request to a protected route (`needs_key`) carries 'Authorization: Bearer
    KEY' with one of the keys. Each key is compared in constant time, so response timing does
    not reveal it."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]) and not self._authorized(scope):
            response = OpenAIError(401, "missing or invalid API key").response()
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = Headers(scope=scope).get("authorization", "")
        supplied = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        matches = [hmac.compare_digest(supplied.encode(), key) for key in self._keys]  # all compared
        return any(matches)


class HostCheck:
    """400 unless the Host header names this server. With no API key (the default) a web page
    could point a name of its own at 127.0.0.1 (DNS rebinding) and then read the answers as
    same-origin; the name it must use is not one this server answers to."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self._allowed = tuple(host.lower().rstrip(".") for host in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self._allowed:
            host = Headers(scope=scope).get("host", "")
            if not any(_host_matches(host_name(host), pattern) for pattern in self._allowed):
                shown = host[:64] or "none"
                message = f"this server does not answer to the Host {shown!r} (see --allowed-hosts)"
                return await _send_json(send, 400, error_body(400, message))
        await self.app(scope, receive, send)


def host_name(host_header: str) -> str:
    """'Example.com:8000' → 'example.com'; '[::1]:8000' → '::1'."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host.rstrip(".")


def _host_matches(name: str, pattern: str) -> bool:
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


class OriginCheck:
    """403 for a request a web page on another origin made (it carries an `Origin` header that
    is neither this server's own nor allowed by `--allowed-origins`), before it reaches any
    route: answering without CORS headers would stop the page reading the answer, not the
    request from running. Requests without an Origin (curl, SDKs) are not browsers' and pass."""

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self._any = "*" in allowed_origins
        self._allowed = {origin.lower().rstrip("/") for origin in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._any:
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and not self._allowed_origin(origin.lower(), headers.get("host", "")):
                message = f"cross-origin request from {origin[:64]!r} refused (see --allowed-origins)"
                return await _send_json(send, 403, error_body(403, message))
        await self.app(scope, receive, send)

    def _allowed_origin(self, origin: str, host: str) -> bool:
        if origin in self._allowed:
            return True
        try:
            return urlsplit(origin).netloc == host.lower() != ""  # the page came from this server
        except ValueError:
            return False


class InFlight:
    """Counts the HTTP requests being served (from the first byte of the request to the last
    of its answer): the garbage collector waits for none (see collector.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.count = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


def needs_key(path: str) -> bool:
    """The OpenAI routes and the tokenizer routes; /health, /metrics and the chat page are open."""
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


async def _send_json(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": payload})

"""The HTTP server around the app: uvicorn, with the connection limits it lacks and a drain.

uvicorn's HTTP/1.1 protocol has no header or body read timeout (a half-sent header stayed
open for as long as the client liked) and no cap on open connections short of the descriptor
limit; its header size cap (h11's) applies only to headers that arrive in pieces.
`GuardedH11Protocol` adds them: a request's headers must arrive within `header_timeout_s` of
its first byte (or of the connection opening) and fit `MAX_HEADER_BYTES` (else 431), a body
may pause at most `read_timeout_s`, and past `max_connections` a connection is answered 503
and closed. Every answer it sends itself is an OpenAI error body.

`DrainingServer` makes SIGTERM a drain: uvicorn stops accepting and closes idle connections,
running requests get `shutdown_timeout_s` to finish, then `on_shutdown`'s deadline ends the
rest with an error (streams: an error event and `[DONE]`); the process then exits 0 (uvicorn
itself would re-raise the signal and die by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import h11
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mmserve.config import ServerConfig
from mmserve.entrypoints.openai.errors import error_body

logger = logging.getLogger("mmserve.http")

_SHUTDOWN_MARGIN_S = 3.0  # after the drain deadline, for the last error events to go out
MAX_HEADER_BYTES = 32 << 10  # a request line and headers (nginx's default buffers hold 32 KiB)
LINGER_S = 2.0  # how long a connection answered with an error still reads what the client sends


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    read_timeout_s: float


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and read timeouts (see the module doc).
    `limits` is set on the subclass `guarded_protocol` makes."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # of the request whose headers are arriving
        self._lingering = False  # answered with an error: reading only to drop, then closing

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Answered once its request is read (closing now could reset the connection before
            # the client reads the answer); the header timeout bounds how long that may take.
            logger.warning(
                "%d connections open, over the limit of %d",
                len(self.connections),
                self.limits.max_connections,
            )
            self.app = _over_capacity(self.limits.max_connections)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self.conn.their_state is h11.IDLE and not self._headers_fit(data):
            self._write_error_and_close(431, f"the request headers exceed {MAX_HEADER_BYTES:,} bytes")
            return
        super().data_received(data)
        self._watch_request()

    def _headers_fit(self, data: bytes) -> bool:
        """Count the header bytes in `data` (up to the blank line that ends them, if it is in
        `data`); False once they exceed `MAX_HEADER_BYTES`."""
        end = data.find(b"\r\n\r\n")
        seen = self._header_bytes + (len(data) if end < 0 else end + 4)
        self._header_bytes = seen if end < 0 else 0
        return seen <= MAX_HEADER_BYTES

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (uvicorn answers it in plain text)."""
        self._write_error_and_close(400, "invalid HTTP request")

    def _watch_request(self) -> None:
        """Arm or cancel the timers for where the request being received now is."""
        state = self.conn.their_state
        if state is h11.IDLE:  # the next request's headers have begun arriving
            self._arm_header_timer()
        elif self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if state is h11.SEND_BODY:
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._headers_timed_out)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._read_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._read_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being sent; the next request waits for it
        seconds = self.limits.header_timeout_s
        self._write_error_and_close(408, f"the request headers did not arrive within {seconds:g} s")

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # the app is not reading: not the client's pause
            self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)
            return
        if self.cycle is not None and not self.cycle.response_started:
            seconds = self.limits.read_timeout_s
            self._write_error_and_close(408, f"the request body paused for more than {seconds:g} s")
        else:
            self.transport.close()  # the app then sees the client disconnect

    def _write_error_and_close(self, status: int, message: str) -> None:
        """Written past h11 (its state may not allow a response now); the connection ends with
        a lingering close, as nginx's: the answer, then end of our side (FIN), then what the
        client still sends is read and dropped until it closes or `LINGER_S` passes. Closing at
        once with bytes of the client's unread makes the kernel reset the connection, and the
        client's read of the answer then fails."""
        body = json.dumps(error_body(status, message)).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self._cancel_timers()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self.flow.resume_reading()  # paused reading would leave the client's bytes unread
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)  # a no-op once the client closed


_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, carrying `limits`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def _over_capacity(max_connections: int):
    """An ASGI app answering 503 (with `Connection: close`) to a connection past the cap."""
    message = f"the server has too many open connections (limit {max_connections}); retry later"
    body = json.dumps(error_body(503, message)).encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"retry-after", b"1"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server; SIGTERM drains (see the module doc) and the process then exits 0.
    `on_shutdown` runs in the loop when shutdown begins (new connections are refused then)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self.interrupted = False  # a Ctrl+C (SIGINT) began the shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.interrupted = self.interrupted or sig == signal.SIGINT
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            if threading.current_thread() is threading.main_thread():
                # Replaces uvicorn's handler for SIGTERM only: it would re-raise the signal at
                # the end and the process would die by it instead of exiting 0.
                signal.signal(signal.SIGTERM, self._drain_on_sigterm)
            yield

    def _drain_on_sigterm(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a second SIGTERM: stop waiting for requests
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)


def build_server(
    app, config: ServerConfig, log_level: str, on_shutdown: Callable[[], None]
) -> DrainingServer:
    limits = ConnectionLimits(config.max_connections, config.header_timeout_s, config.read_timeout_s)
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level.lower(),
            http=guarded_protocol(limits),
            timeout_keep_alive=config.keep_alive_timeout_s,
            h11_max_incomplete_event_size=2 * MAX_HEADER_BYTES,  # the cap above answers first
            timeout_graceful_shutdown=config.shutdown_timeout_s + _SHUTDOWN_MARGIN_S,
        ),
        on_shutdown,
    )

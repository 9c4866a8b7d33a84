"""Issue 20, class 6 (connections) and the CORS flags, on a server of its own: a client that
sends half a header, pauses its body, opens connections past the cap, or speaks malformed HTTP
gets an OpenAI error body and its connection closed, never an open socket for as long as it
likes; an allowed origin gets CORS headers. After each case the server answers exactly.

Waits here are bounds on a hang (`RECV_TIMEOUT_S`), not timing thresholds.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import pytest
from reliability_util import VALID, Hardened, assert_still_serving, serve

MAX_CONNECTIONS = 8
HEADER_TIMEOUT_S = 2
RECV_TIMEOUT_S = 30
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def guarded(model_path, tmp_path_factory):
    server = serve(
        model_path,
        "--preprocess-workers",
        "1",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--read-timeout",
        "1",
        "--keep-alive-timeout",
        "1",
        "--allowed-origins",
        APP_ORIGIN,
        "--allowed-hosts",
        "127.0.0.1",
        "app-host.example",
        log_path=tmp_path_factory.mktemp("guarded") / "log",
    )
    try:
        server.wait_healthy(180)
        yield Hardened(server, None, None, None, {})  # type: ignore[arg-type]
    finally:
        server.stop()


def connect(server: Hardened) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.server.port), timeout=RECV_TIMEOUT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a hang fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


def parse(response: bytes) -> tuple[int, dict, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_error(response: bytes, status: int, contains: str) -> dict:
    code, headers, body = parse(response)
    assert code == status, response[:300]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert contains in body["error"]["message"], body
    assert headers.get("content-type") == "application/json"
    return headers


REQUEST_HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def test_a_half_sent_header_is_answered_408_and_closed(guarded, valid_answer):
    """Was held open for as long as the client liked (90 s in the red-team run)."""
    sock = connect(guarded)
    sock.sendall(REQUEST_HEAD.encode())  # and never the blank line
    assert_error(read_until_closed(sock), 408, "headers did not arrive")
    assert_still_serving(guarded, valid_answer)


def test_a_header_sent_a_byte_at_a_time_still_has_one_deadline(guarded, valid_answer):
    sock = connect(guarded)
    sock.settimeout(0.5)
    answer = b""
    for byte in REQUEST_HEAD.encode() * 20:  # far longer than the timeout at one byte per 0.1 s
        try:
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
        except OSError:  # the server closed it
            break
        try:
            answer += sock.recv(65536)
        except TimeoutError:
            continue
        if answer:
            break
    sock.settimeout(RECV_TIMEOUT_S)
    assert_error(answer + read_until_closed(sock), 408, "headers did not arrive")
    assert_still_serving(guarded, valid_answer)


def test_a_paused_body_is_answered_408_and_closed(guarded, valid_answer):
    sock = connect(guarded)
    head = REQUEST_HEAD + "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    sock.sendall(head.encode() + b'{"messages": [')
    assert_error(read_until_closed(sock), 408, "body paused")
    assert_still_serving(guarded, valid_answer)


def test_connections_past_the_cap_get_a_503_and_the_cap_frees_up(guarded, valid_answer):
    time.sleep(1.5)  # earlier keep-alive connections have closed
    held = [connect(guarded) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # all accepted
        extra = connect(guarded)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        headers = assert_error(read_until_closed(extra), 503, "too many open connections")
        assert headers["connection"] == "close" and headers["retry-after"] == "1"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert_still_serving(guarded, valid_answer)


def test_malformed_http_gets_a_json_400(guarded, valid_answer):
    sock = connect(guarded)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    assert_error(read_until_closed(sock), 400, "invalid HTTP request")
    assert_still_serving(guarded, valid_answer)


@pytest.mark.parametrize("pieces", [1, 40], ids=["in_one_packet", "in_pieces"])
def test_an_oversized_header_gets_a_json_431(guarded, valid_answer, pieces):
    """Was: 40 KB of headers in one packet were accepted (h11 caps only headers in pieces)."""
    sock = connect(guarded)
    head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {'a' * 40_000}\r\n\r\n".encode()
    step = -(-len(head) // pieces)
    try:
        for start in range(0, len(head), step):
            sock.sendall(head[start : start + step])
    except OSError:  # closed by the server part-way
        pass
    assert_error(read_until_closed(sock), 431, "request headers exceed")
    assert_still_serving(guarded, valid_answer)


def test_a_client_still_sending_after_its_431_reads_the_431(guarded, valid_answer):
    """Was (a flaky CI run): the server closed the socket right after its answer; bytes of the
    client's it had not read yet made the kernel reset the connection instead of closing it, and
    the client's read after the 431 failed (ConnectionResetError). Here the header is followed
    by more than the server reads at once (asyncio reads 256 KiB), so some is always unread."""
    sock = connect(guarded)
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 600_000 + b"\r\n\r\n"
    with contextlib.suppress(OSError):  # the server may close before it has all of it
        sock.sendall(head)
    assert_error(read_until_closed(sock), 431, "request headers exceed")
    assert_still_serving(guarded, valid_answer)


def test_large_but_allowed_headers_are_served(guarded, valid_answer):
    cookies = {"cookie": "session=" + "c" * 20_000}  # a 20 KB cookie, under the 32 KiB cap
    response = httpx.get(guarded.url + "/health", headers=cookies, timeout=10)
    assert response.status_code == 200
    assert_still_serving(guarded, valid_answer)


def test_an_idle_keep_alive_connection_is_closed(guarded, valid_answer):
    sock = connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = read_until_closed(sock)  # returns only because the server closes the idle connection
    assert answer.startswith(b"HTTP/1.1 200")
    assert_still_serving(guarded, valid_answer)


def test_an_allowed_origin_gets_cors_headers_and_others_are_refused(guarded, valid_answer):
    preflight = httpx.options(
        guarded.url + "/v1/chat/completions",
        headers={"origin": APP_ORIGIN, "access-control-request-method": "POST"},
        timeout=10,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    answer = httpx.post(
        guarded.url + "/v1/chat/completions", json=VALID, headers={"origin": APP_ORIGIN}, timeout=60
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP_ORIGIN
    assert answer.json()["choices"][0]["message"]["content"] == valid_answer
    other = httpx.post(
        guarded.url + "/v1/chat/completions",
        json=VALID,
        headers={"origin": "https://other.example"},
        timeout=60,
    )
    assert other.status_code == 403 and other.json()["error"]["type"] == "permission_error"
    assert_still_serving(guarded, valid_answer)


def test_an_explicit_host_list_replaces_the_loopback_default(guarded, valid_answer):
    listed = httpx.post(
        guarded.url + "/v1/chat/completions", json=VALID, headers={"host": "app-host.example"}, timeout=60
    )
    assert listed.status_code == 200, listed.text
    unlisted = httpx.get(guarded.url + "/health", headers={"host": "localhost"}, timeout=10)
    assert unlisted.status_code == 400 and "Host" in unlisted.json()["error"]["message"]
    assert_still_serving(guarded, valid_answer)

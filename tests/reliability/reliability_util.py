"""Helpers shared by the reliability tests and the soak script: server processes and what they
hold (/proc, /dev/shm, /metrics), hostile image bytes, and a tiny local HTTP image server."""

from __future__ import annotations

import base64
import io
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
from PIL import Image

from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import ServerProcess, descendants

# ----------------------------------------------------------------------------------- the hardened server

API_KEY = "sk-reliability-7f3c9a1e5b2d4f6a8c0e"
MAX_NUM_SEQS = 4
MAX_WAITING = 8
KV_BLOCKS = 24  # 768 KiB at 32 KiB per block (block size 16) for the tiny model
GOOD_PNG = png_bytes(synthetic_image(64, 64, seed=0))
# The request run after every hostile one; its answer must equal the offline greedy answer.
VALID = {"messages": [{"role": "user", "content": "Say something."}], "temperature": 0, "max_tokens": 2}


@dataclass
class Hardened:
    server: ServerProcess
    media: Path  # the --allowed-local-media-path root
    outside: Path  # a sibling directory holding files the server must never read
    images: ImageHost  # an http server on 127.0.0.1 (allowlisted as "127.0.0.1" and "localhost")
    headers: dict

    @property
    def url(self) -> str:
        return self.server.url

    def post(self, route: str, body, timeout: float = 60, **kwargs) -> httpx.Response:
        """`body`: a dict sent as JSON, or bytes (or an iterator of bytes, sent chunked) as is."""
        if not isinstance(body, dict):
            headers = {**self.headers, "content-type": "application/json"}
            return httpx.post(self.url + route, content=body, headers=headers, timeout=timeout, **kwargs)
        return httpx.post(self.url + route, json=body, headers=self.headers, timeout=timeout, **kwargs)


def assert_still_serving(hardened: Hardened, valid_answer: str) -> None:
    """/health is 200 and a valid request returns exactly the offline greedy answer."""
    assert httpx.get(hardened.url + "/health", timeout=10).status_code == 200
    response = hardened.post("/v1/chat/completions", VALID)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == valid_answer


# ----------------------------------------------------------------------------------- hostile cases

CHAT = "/v1/chat/completions"
Body = dict | bytes | Callable[[Hardened], dict | bytes]


@dataclass(frozen=True)
class Case:
    """One hostile request: what is sent (`body`, or a function of the server), to which route,
    the status it must get and a fragment of its error message."""

    id: str
    body: Body
    status: int
    contains: str = ""
    route: str = CHAT
    # run after the response, with the image host's hit counts from before the request
    check: Callable[[Hardened, dict], None] | None = field(default=None, compare=False)


def chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def with_image(url: str, **extra) -> dict:
    return chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}], **extra)


def image_bytes(data: bytes, media_type: str = "image/png") -> dict:
    return with_image(data_url(data, media_type))


def materialise(body: Body, hardened: Hardened) -> dict | bytes:
    return body(hardened) if callable(body) else body


# ----------------------------------------------------------------------------------- responses


def assert_openai_error(response: httpx.Response, status: int, contains: str = "") -> dict:
    """`response` is `status` with exactly {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert contains.lower() in error["message"].lower(), (contains, error)
    return error


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """Sum of a Prometheus sample over its label sets."""
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=10).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def idle_gauges(url: str, headers: dict | None = None) -> dict[str, float]:
    names = (
        "mmserve:kv_cache_blocks_in_use",
        "mmserve:encoder_cache_references",
        "mmserve:num_requests_running",
        "mmserve:num_requests_waiting",
    )
    return {n: metric(url, n, headers) for n in names}


# ----------------------------------------------------------------------------------- processes


def serve(model: str | Path, *args: str, log_path: Path, threads: int = 1) -> ServerProcess:
    """`mmserve serve` with `threads` torch threads in EngineCore. On a small, busy machine the
    default (one per core) oversubscribes it: a decode step of the tiny model then takes ~50-300 ms
    instead of ~5 ms, which would make these tests as slow as they are pointless."""
    return ServerProcess(model, *args, log_path=log_path, env={"MMSERVE_NUM_THREADS": str(threads)})


def engine_pid(server: ServerProcess) -> int:
    match = re.search(r"EngineCore pid (\d+)", server.log_path.read_text(errors="replace"))
    assert match, server.log()
    return int(match.group(1))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def preprocess_worker_pids(server: ServerProcess) -> set[int]:
    """Spawned children of the server other than EngineCore (the resource tracker is not spawned
    with spawn_main, so it is not counted)."""
    engine = engine_pid(server)
    return {
        pid
        for pid in descendants(server.proc.pid)
        if pid != engine and "spawn_main" in cmdline(pid) and _ppid(pid) == server.proc.pid
    }


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def segment_prefix(server: ServerProcess, timeout_s: float = 10.0) -> str:
    """The preprocess pool's shared-memory prefix (`mmserve_pp_<hex>_`), read from the server's
    memory map: a cached image keeps its segment mapped. Send one image request first."""
    found: list[str] = []

    def look() -> bool:
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        found[:] = sorted(set(re.findall(r"mmserve_pp_[0-9a-f]+_", maps)))
        return bool(found)

    assert wait_for(look, timeout_s), "no preprocess segment mapped in the server"
    assert len(found) == 1, found
    return found[0]


def segments(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix))


# ----------------------------------------------------------------------------------- images


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int, color_type: int = 2) -> bytes:
    """A PNG that announces width×height and carries one tiny IDAT: a bomb by its header."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    chunks = png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + chunks


def jpeg_with_declared_size(width: int, height: int) -> bytes:
    """A 16×16 JPEG whose SOF0 header claims width×height."""
    data = bytearray(encode(Image.new("L", (16, 16)), "JPEG"))
    sof = data.find(b"\xff\xc0")
    data[sof + 5 : sof + 7] = height.to_bytes(2, "big")
    data[sof + 7 : sof + 9] = width.to_bytes(2, "big")
    return bytes(data)


def with_text_chunk(png: bytes, text: str) -> bytes:
    """The same pixels with a different byte string (so a different content hash)."""
    end = png.rindex(b"IEND") - 4
    return png[:end] + png_chunk(b"tEXt", b"Comment\0" + text.encode()) + png[end:]


def large_png(width: int, height: int, seed: int = 0) -> bytes:
    """A big, cheap-to-send image (smooth, so it compresses) that is slow to decode."""
    return png_bytes(synthetic_image(256, 256, seed).resize((width, height), Image.BILINEAR))


# ----------------------------------------------------------------------------------- http server


class ImageHost:
    """An HTTP server on 127.0.0.1 (a thread) for image-fetch tests.

    GET /img.png → a PNG;  /redirect?to=URL → 302 to URL;  /loop → 302 to itself;
    /missing → 404;  /gzip → a gzip-encoded body;  /slow → one byte a second, forever.
    `hits` counts requests per path.
    """

    def __init__(self, png: bytes) -> None:
        host = self
        self.png = png
        self.hits: dict[str, int] = {}
        self.host_headers: list[str] = []
        self.deflate_bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB of zeros in ~64 KiB

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                host.hits[parsed.path] = host.hits.get(parsed.path, 0) + 1
                host.host_headers.append(self.headers.get("Host", ""))
                if parsed.path == "/img.png":
                    self._send(200, host.png, "image/png")
                elif parsed.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", parse_qs(parsed.query)["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif parsed.path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif parsed.path == "/gzip":
                    body = host.deflate_bomb
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Encoding", "deflate")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif parsed.path == "/slow":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    try:
                        for _ in range(600):
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                            time.sleep(1.0)
                    except OSError:
                        pass
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, status: int, body: bytes, media_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

"""Turning an `image_url` or a `video_url` into bytes: data URLs, allowed local files, allowed
http(s) hosts.

Everything a client controls is checked here before any byte is read: the URL scheme, base64
validity, that a local path stays under the allowed root after resolving symlinks, and sizes.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from mmserve.frontend.media_error import MediaError

# Base64 is decoded this many characters at a time: `b64decode` holds the GIL, and 27 MB of it
# in one call (a 20 MiB image) kept every other thread, the event loop's included, waiting
# ~0.1 s. A multiple of 4, so each piece decodes on its own.
_BASE64_PIECE_CHARS = 1 << 20


class RawDataUrl:
    """A data URL left as the bytes of the request body it came in (see
    entrypoints/openai/long_strings.py): decoded from there in pieces, never made a `str`."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"<a data URL of {len(self.data):,} bytes>"


IMAGE_MEDIA_TYPES = ("image/",)
VIDEO_MEDIA_TYPES = ("video/", "image/gif")
_MAX_DATA_URL_HEADER = 256


def decode_data_url(
    url: str | RawDataUrl, max_bytes: int, media_types: tuple[str, ...] = IMAGE_MEDIA_TYPES
) -> bytes:
    header, sep, payload = _split_data_url(url)
    if not sep:
        raise MediaError("malformed data URL: no ',' separating the header from the data")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise MediaError(f"data URLs must look like data:{media_types[0]}<type>;base64,<data>")
    media_type = header[len("data:") : -len(";base64")]
    if media_type and not media_type.startswith(media_types):
        kind = "a video" if media_types == VIDEO_MEDIA_TYPES else "an image"
        raise MediaError(f"data URL media type {media_type!r} is not {kind}")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaError(f"image data exceeds the {max_bytes} byte limit")
    return _b64decode_in_pieces(payload)


def _split_data_url(url: str | RawDataUrl) -> tuple[str, str, str | memoryview]:
    if isinstance(url, str):
        return url.partition(",")
    comma = url.data[:_MAX_DATA_URL_HEADER].tobytes().find(b",")
    if comma < 0:
        return "", "", ""
    return url.data[:comma].tobytes().decode("ascii", "replace"), ",", url.data[comma + 1 :]


def _b64decode_in_pieces(payload: str | memoryview) -> bytes:
    """`base64.b64decode(payload, validate=True)`, decoded in pieces so that other threads run
    in between. Padding may only end the whole payload, as in one call."""
    pieces = []
    for start in range(0, len(payload), _BASE64_PIECE_CHARS):
        piece = payload[start : start + _BASE64_PIECE_CHARS]
        piece = piece.tobytes() if isinstance(piece, memoryview) else piece
        last = start + _BASE64_PIECE_CHARS >= len(payload)
        if ("=" if isinstance(piece, str) else b"=") in (piece[:-2] if last else piece):
            raise MediaError("invalid base64 image data: padding before the end")
        try:
            pieces.append(base64.b64decode(piece, validate=True))
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"invalid base64 image data: {e}") from None
    return b"".join(pieces)


def read_local_file(path_text: str, allowed_root: Path | None, max_bytes: int) -> bytes:
    if allowed_root is None:
        raise MediaError("local image files are disabled; start the server with --allowed-local-media-path")
    shown = path_text if len(path_text) <= 200 else path_text[:197] + "..."
    try:
        path = Path(unquote(path_text))
        if not path.is_absolute():
            raise MediaError("local image paths must be absolute")
        resolved = Path(os.path.realpath(path))
        root = Path(os.path.realpath(allowed_root))
        if not resolved.is_relative_to(root):
            raise MediaError(f"{shown!r} is outside the allowed media directory")
        return _read_regular_file(resolved, max_bytes)
    except MediaError:
        raise
    except (OSError, ValueError):  # a name too long, a NUL byte, a permission, a race
        raise MediaError(f"{shown!r} is not a readable file") from None


def _read_regular_file(resolved: Path, max_bytes: int) -> bytes:
    """Read an already resolved path; what is checked is the file actually opened (not followed
    if it became a link, never a device or a FIFO), and no more than the limit is read."""
    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{str(resolved)[:200]!r} is not a readable file")
        if info.st_size > max_bytes:
            raise MediaError(f"image file exceeds the {max_bytes} byte limit")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise MediaError(f"image file exceeds the {max_bytes} byte limit")
    return data


class MediaLoader:
    def __init__(
        self,
        allowed_local_media_path: str | Path | None = None,
        allowed_media_domains: list[str] | None = None,
        max_image_bytes: int = 20 << 20,
        fetch_timeout_s: float = 10.0,
        max_video_bytes: int = 48 << 20,
    ) -> None:
        self.allowed_root = Path(allowed_local_media_path) if allowed_local_media_path else None
        self.allowed_domains = [d.lower() for d in allowed_media_domains or []]
        self.max_image_bytes = max_image_bytes
        self.max_video_bytes = max_video_bytes
        self.fetch_timeout_s = fetch_timeout_s

    def load(self, url: str | RawDataUrl) -> bytes:
        """Bytes of the image behind `url`; raises MediaError with a client-facing message."""
        if not isinstance(url, str | RawDataUrl) or not url:
            raise MediaError("image_url.url must be a non-empty string")
        return self._load(url, self.max_image_bytes, IMAGE_MEDIA_TYPES)

    def load_video(self, url: str | RawDataUrl) -> bytes:
        """Bytes of the video behind `url` (the same sources as images, a larger size limit)."""
        if not isinstance(url, str | RawDataUrl) or not url:
            raise MediaError("video_url.url must be a non-empty string")
        return self._load(url, self.max_video_bytes, VIDEO_MEDIA_TYPES)

    def _load(self, url: str | RawDataUrl, max_bytes: int, media_types: tuple[str, ...]) -> bytes:
        if isinstance(url, RawDataUrl) or url.startswith("data:"):
            return decode_data_url(url, max_bytes, media_types)
        parsed = urlparse(url)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise MediaError("file:// URLs must not name a host")
            return read_local_file(parsed.path, self.allowed_root, max_bytes)
        if parsed.scheme in ("http", "https"):
            from mmserve.frontend.http_fetch import fetch_image

            return fetch_image(url, self.allowed_domains, max_bytes, self.fetch_timeout_s)
        if parsed.scheme == "" and url.startswith("/"):
            return read_local_file(url, self.allowed_root, max_bytes)
        raise MediaError(f"unsupported image URL scheme {parsed.scheme or url[:16]!r}")

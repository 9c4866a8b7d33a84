"""Long strings cut out of a JSON body before it is parsed.

A JSON parser holds the GIL for the whole document: a 24 MB body carrying one image as a data
URL kept every other request (and /health) waiting ~0.1 s on a busy machine while msgspec
made a 24 MB `str`. Nearly all of such a body is one string, so `cut` finds every string
token of at least `MIN_BYTES` without escapes or control characters and replaces it by a
short marker (with a random nonce: a client cannot forge one) before parsing; `restore` puts
it back after. A data URL under an `url` key comes back as a `RawDataUrl` over the body's
bytes (decoded from there in pieces, never made into a `str`); any other string as a `str`.

Each step is a C call over at most `_PIECE` bytes (the GIL is let go in between), so this can
run in a thread while the loop serves others. Token boundaries are exact: quotes are counted
with escapes (a quote after an odd run of backslashes is text), and the parser then checks
the rest as usual. A body that is not valid JSON stays invalid: only the content of string
tokens is replaced, by other valid string content.
"""

from __future__ import annotations

import secrets

from mmserve.frontend.media import RawDataUrl

MIN_BYTES = 1 << 16
_PIECE = 1 << 20
_CONTROL = bytes(range(0x20))
_MAX_BACKSLASH_RUNS = 100_000  # beyond this, quote counting costs too much: nothing is cut


class Cut:
    """The body with long strings replaced by markers, and what the markers stand for."""

    def __init__(self, document: bytes, strings: list[memoryview], nonce: str) -> None:
        self.document = document
        self.strings = strings
        self.nonce = nonce

    def restore(self, value: object, key: str | None = None) -> object:
        """`value` (the parsed document) with every marker replaced by its string."""
        if not self.strings:
            return value
        if isinstance(value, dict):
            return {name: self.restore(item, name) for name, item in value.items()}
        if isinstance(value, list):
            return [self.restore(item) for item in value]
        if isinstance(value, str) and value.startswith(self.nonce):
            raw = self.strings[int(value[len(self.nonce) :])]
            if key == "url" and raw[:5] == b"data:":
                return RawDataUrl(raw)
            return str(raw, "utf-8")  # UnicodeDecodeError (a ValueError): not valid JSON
        return value


def cut(data: bytes) -> Cut:
    nonce = f"\0{secrets.token_hex(8)}:"
    strings: list[memoryview] = []
    pieces: list[bytes] = []
    view = memoryview(data)
    copied = 0  # data[:copied] is in `pieces`
    counted, quotes = 0, 0  # unescaped quotes in data[:counted]
    window = 0
    while window + MIN_BYTES // 2 <= len(data):
        if data.find(b'"', window, window + MIN_BYTES // 2) >= 0:
            window += MIN_BYTES // 2
            continue
        # A quote-free stretch: a long string, or a long run of numbers and brackets.
        start = data.rfind(b'"', counted, window)
        end = data.find(b'"', window)
        if start < 0 or end < 0:
            break
        found = _unescaped_quotes(data, counted, start)
        if found is None:
            break
        quotes += found
        opening = not _escaped(data, start)
        if opening and quotes % 2 == 0 and _plain(data, start + 1, end):
            pieces += [data[copied : start + 1], f"{nonce}{len(strings)}".encode().replace(b"\0", b"\\u0000")]
            strings.append(view[start + 1 : end])
            copied = counted = end  # the closing quote is copied and counted with what follows
        else:  # counting resumes after this quote, never at one a backslash before it escapes
            counted = start + 1
        quotes += opening
        window = end + 1
    if not strings:
        return Cut(data, [], nonce)
    pieces.append(data[copied:])
    return Cut(b"".join(pieces), strings, nonce)


def _unescaped_quotes(data: bytes, start: int, end: int) -> int | None:
    """Quotes in data[start:end] that end a string or begin one (not preceded by an odd run of
    backslashes); None if there are too many backslashes to count them cheaply."""
    quotes = data.count(b'"', start, end)
    position, runs = data.find(b"\\", start, end), 0
    while position >= 0:
        runs += 1
        if runs > _MAX_BACKSLASH_RUNS:
            return None
        run_end = position
        while run_end < end and data[run_end] == 0x5C:
            run_end += 1
        if (run_end - position) % 2 and run_end < end and data[run_end] == 0x22:
            quotes -= 1
        position = data.find(b"\\", run_end, end)
    return quotes


def _escaped(data: bytes, quote: int) -> bool:
    run = 0
    while quote - run - 1 >= 0 and data[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 1


def _plain(data: bytes, start: int, end: int) -> bool:
    """Long enough, and no escape or control character (its bytes are then its UTF-8 text)."""
    if end - start < MIN_BYTES or data.find(b"\\", start, end) >= 0:
        return False
    for piece in range(start, end, _PIECE):
        chunk = data[piece : min(end, piece + _PIECE)]
        if len(chunk.translate(None, _CONTROL)) != len(chunk):
            return False
    return True

"""Uploaded files (OpenAI's Files API): images stored once and referred to by id afterwards.

Each file lives under `directory/<owner>/` as its bytes (`<id>`) and its record (`<id>.json`),
so a restarted server still serves the ids its clients saved. Ids carry 128 random bits; the
owner is a digest of the API key that uploaded the file ("" without keys), and a file is only
ever visible to its owner: another owner's id is indistinguishable from one that never existed.
Each owner has a byte and a file-count quota; files expire `ttl_s` after their upload and are
swept on the next access. The image's mm_hash is computed here from the bytes, never taken
from a client, and stored with the record: a chat turn that refers to the file need not even
read it when the engine already holds the image.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

_ID = re.compile(r"file-[0-9a-f]{32}")
_OWNER = re.compile(r"[0-9a-f]{0,64}")


class FileStoreError(ValueError):
    """The client's upload or reference cannot be served; the message is safe to show them."""


class FileNotFound(FileStoreError):
    """No such file for this owner (never uploaded, deleted, expired or someone else's)."""


class QuotaExceeded(FileStoreError):
    """The owner's byte or file-count quota would be exceeded."""


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int  # unix seconds
    expires_at: int | None
    mm_hash: str

    def to_openai(self) -> dict:
        """The file object as OpenAI's API returns it."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


@dataclass(frozen=True)
class StoredImage:
    """A chat part's uploaded image: its hash at once, its bytes when `read` is called."""

    mm_hash: str
    read: Callable[[], bytes]


FileResolver = Callable[[str], StoredImage]  # file id → image (raises FileNotFound)


class FileStore:
    """Thread-safe. `max_bytes` / `max_files` are per owner; `ttl_s` None: files never expire."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int = 1 << 30,
        max_files: int = 1000,
        ttl_s: float | None = 7 * 24 * 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        for record in self.directory.glob("*/file-*.json"):
            try:
                stored = StoredFile(**json.loads(record.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # a record cut short by a crash: its file is unreachable, as if never stored
            self._files[stored.id] = stored

    def add(self, owner: str, filename: str, purpose: str, data: bytes, mm_hash: str) -> StoredFile:
        """Store `data` (already validated as an image by the caller) for `owner`."""
        now = self._clock()
        with self._lock:
            self._sweep(now)
            mine = [f for f in self._files.values() if f.owner == owner]
            if len(mine) + 1 > self.max_files:
                raise QuotaExceeded(f"the file quota of {self.max_files} files is reached; delete some first")
            if sum(f.bytes for f in mine) + len(data) > self.max_bytes:
                raise QuotaExceeded(f"the storage quota of {self.max_bytes} bytes would be exceeded")
            expires_at = int(now + self.ttl_s) if self.ttl_s is not None else None
            stored = StoredFile(
                id=f"file-{secrets.token_hex(16)}",
                owner=owner,
                filename=filename[:255],
                purpose=purpose,
                bytes=len(data),
                created_at=int(now),
                expires_at=expires_at,
                mm_hash=mm_hash,
            )
            self._files[stored.id] = stored  # counted against the quota at once
        try:
            self._write(stored, data)
        except BaseException:
            with self._lock:
                self._files.pop(stored.id, None)
            self._remove(stored)
            raise
        return stored

    def get(self, owner: str, file_id: str) -> StoredFile:
        with self._lock:
            self._sweep(self._clock())
            stored = self._files.get(file_id) if isinstance(file_id, str) else None
        if stored is None or stored.owner != owner:
            raise FileNotFound(
                f"no file with id {file_id[:64]!r}" if isinstance(file_id, str) else "no such file"
            )
        return stored

    def list_files(self, owner: str, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files, newest first."""
        with self._lock:
            self._sweep(self._clock())
            mine = [f for f in self._files.values() if f.owner == owner]
        mine = [f for f in mine if purpose is None or f.purpose == purpose]
        return sorted(mine, key=lambda f: (f.created_at, f.id), reverse=True)

    def read(self, owner: str, file_id: str) -> bytes:
        stored = self.get(owner, file_id)
        try:
            return self._data_path(stored).read_bytes()
        except OSError:
            raise FileNotFound(f"no file with id {file_id!r}") from None

    def delete(self, owner: str, file_id: str) -> StoredFile:
        stored = self.get(owner, file_id)
        with self._lock:
            self._files.pop(stored.id, None)
        self._remove(stored)
        return stored

    def resolver(self, owner: str) -> FileResolver:
        """What the input processor calls for a chat part's file id, as `owner`."""

        def resolve(file_id: str) -> StoredImage:
            stored = self.get(owner, file_id)
            return StoredImage(stored.mm_hash, lambda: self.read(owner, stored.id))

        return resolve

    def usage(self, owner: str) -> tuple[int, int]:
        """(files, bytes) the owner holds."""
        mine = self.list_files(owner)
        return len(mine), sum(f.bytes for f in mine)

    def _sweep(self, now: float) -> None:
        """Drop expired files (call with the lock held)."""
        expired = [f for f in self._files.values() if f.expires_at is not None and f.expires_at <= now]
        for stored in expired:
            del self._files[stored.id]
            self._remove(stored)

    def _owner_dir(self, owner: str) -> Path:
        if not _OWNER.fullmatch(owner):
            raise ValueError("owner must be a hex digest")
        return self.directory / (owner or "anonymous")

    def _data_path(self, stored: StoredFile) -> Path:
        if not _ID.fullmatch(stored.id):
            raise FileNotFound("no such file")
        return self._owner_dir(stored.owner) / stored.id

    def _write(self, stored: StoredFile, data: bytes) -> None:
        """Bytes first, record last (atomically): a crash leaves no record without its bytes."""
        path = self._data_path(stored)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record = path.with_suffix(".json.tmp")
        record.write_text(json.dumps(asdict(stored)))
        os.replace(record, path.with_suffix(".json"))

    def _remove(self, stored: StoredFile) -> None:
        path = self._data_path(stored)
        for leftover in (path.with_suffix(".json"), path):
            leftover.unlink(missing_ok=True)

"""The Files API's store: ids of 128 random bits, files visible to their owner only, per-owner
quotas, expiry, deletion, and records that survive a restart."""

from __future__ import annotations

import re

import pytest

from mmserve.frontend.file_store import FileNotFound, FileStore, QuotaExceeded

ALICE, BOB = "a" * 32, "b" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_an_upload_is_read_back_by_its_owner_only(tmp_path):
    store = FileStore(tmp_path)
    stored = store.add(ALICE, "cat.png", "vision", b"png bytes", "hash-1")
    assert re.fullmatch(r"file-[0-9a-f]{32}", stored.id)
    assert store.read(ALICE, stored.id) == b"png bytes"
    assert store.get(ALICE, stored.id).mm_hash == "hash-1"
    assert [f.id for f in store.list_files(ALICE)] == [stored.id]
    assert store.list_files(BOB) == []
    for action in (store.get, store.read, store.delete):
        with pytest.raises(FileNotFound):
            action(BOB, stored.id)
    with pytest.raises(FileNotFound):
        store.resolver(BOB)(stored.id)
    assert store.resolver(ALICE)(stored.id).read() == b"png bytes"


def test_ids_are_distinct_and_unguessable(tmp_path):
    store = FileStore(tmp_path)
    ids = {store.add(ALICE, "x", "vision", b"x", "h").id for _ in range(50)}
    assert len(ids) == 50


def test_quotas_are_per_owner_in_files_and_bytes(tmp_path):
    store = FileStore(tmp_path, max_bytes=10, max_files=2)
    store.add(ALICE, "one", "vision", b"12345", "h")
    with pytest.raises(QuotaExceeded, match="storage quota"):
        store.add(ALICE, "big", "vision", b"123456", "h")
    store.add(ALICE, "two", "vision", b"12345", "h")
    with pytest.raises(QuotaExceeded, match="file quota"):
        store.add(ALICE, "three", "vision", b"1", "h")
    store.add(BOB, "bob's", "vision", b"12345", "h")  # Bob's quota is his own
    freed = store.list_files(ALICE)[0]
    store.delete(ALICE, freed.id)
    store.add(ALICE, "three", "vision", b"1", "h")  # deleting gave the room back


def test_files_expire_and_leave_the_disk(tmp_path):
    clock = Clock()
    store = FileStore(tmp_path, ttl_s=60, clock=clock)
    stored = store.add(ALICE, "x", "vision", b"x", "h")
    assert stored.expires_at == stored.created_at + 60
    clock.now += 59
    assert store.get(ALICE, stored.id)
    clock.now += 2
    with pytest.raises(FileNotFound):
        store.get(ALICE, stored.id)
    assert not list(tmp_path.rglob("file-*"))


def test_a_deleted_file_is_gone_for_every_use(tmp_path):
    store = FileStore(tmp_path)
    stored = store.add(ALICE, "x", "vision", b"x", "h")
    resolve = store.resolver(ALICE)
    image = resolve(stored.id)
    store.delete(ALICE, stored.id)
    for action in (store.get, store.read, store.delete):
        with pytest.raises(FileNotFound):
            action(ALICE, stored.id)
    with pytest.raises(FileNotFound):
        image.read()  # even through a reference taken before the delete
    assert not list(tmp_path.rglob("file-*"))


def test_records_survive_a_restart_and_a_torn_record_is_ignored(tmp_path):
    stored = FileStore(tmp_path).add(ALICE, "x", "vision", b"bytes", "h")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "file-0.json").write_text("{not json")
    again = FileStore(tmp_path)
    assert again.read(ALICE, stored.id) == b"bytes"
    assert again.get(ALICE, stored.id) == stored


def test_unknown_and_malformed_ids_are_not_found(tmp_path):
    store = FileStore(tmp_path)
    for file_id in ("file-" + "0" * 32, "../../etc/passwd", "", "x" * 10000):
        with pytest.raises(FileNotFound):
            store.get(ALICE, file_id)

"""Streamed writes (Store.open_stream): a pack written piece by piece at offsets from several threads, committed
under a name chosen at the end with put_if_absent's semantics; abandoned ones leave nothing behind."""

from __future__ import annotations

import os
import threading

import pytest

from luopan.errors import StorageError
from luopan.store.base import BufferedStream
from luopan.store.local import LocalStore
from luopan.store.localstream import LocalStream
from luopan.store.memory import MemoryStore
from luopan.store.walk import TMP_MARK


def _temps(root) -> list[str]:
    return [os.path.join(d, n) for d, _s, names in os.walk(root) for n in names if TMP_MARK in n]


@pytest.mark.parametrize("make", [lambda p: LocalStore(p), lambda p: MemoryStore()])
def test_pieces_at_offsets_from_threads_make_one_object(tmp_path, make):
    store = make(tmp_path / "r")
    stream = store.open_stream("packs")
    assert isinstance(stream, LocalStream if isinstance(store, LocalStore) else BufferedStream)
    pieces = [(i * 1000, [memoryview(bytes([i]) * 600), memoryview(bytes([i + 100]) * 400)]) for i in range(20)]
    threads = [threading.Thread(target=stream.write_at, args=p) for p in reversed(pieces)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stream.commit("packs/ab/x.pack")
    expect = b"".join(bytes([i]) * 600 + bytes([i + 100]) * 400 for i in range(20))
    assert store.get("packs/ab/x.pack") == expect
    if isinstance(store, LocalStore):
        assert _temps(tmp_path) == []
    stream.discard()  # after a commit: nothing to undo
    assert store.get("packs/ab/x.pack") == expect


def test_commit_never_replaces_an_existing_key(tmp_path):
    store = LocalStore(tmp_path / "r")
    store.put("packs/ab/x.pack", b"first")
    stream = store.open_stream("packs")
    stream.write_at(0, [memoryview(b"second")])
    assert stream.commit("packs/ab/x.pack") is False
    assert store.get("packs/ab/x.pack") == b"first"
    assert _temps(tmp_path) == []


def test_a_discarded_stream_leaves_nothing(tmp_path):
    store = LocalStore(tmp_path / "r")
    stream = store.open_stream("packs")
    stream.write_at(0, [memoryview(b"x" * 4096)])
    assert len(_temps(tmp_path)) == 1  # a locked temp file while in flight: cleanup leaves it alone
    assert store.cleanup_temporaries() == 0
    stream.discard()
    assert _temps(tmp_path) == []
    assert list(store.list("packs/")) == []


def test_write_errors_are_typed(tmp_path, monkeypatch):
    import errno

    store = LocalStore(tmp_path / "r")
    stream = store.open_stream("packs")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(StorageError, match="no space left"):
        stream.write_at(0, [memoryview(b"x")])
    monkeypatch.undo()
    stream.discard()
    assert _temps(tmp_path) == []

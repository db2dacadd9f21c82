"""A committed write reports success (issue 27, smaller gaps).

Once a checkpoint's manifest (an artifact version's, an index snapshot's) is in place, what follows is cleanup: the
temp name it was linked from, closing file descriptors, trimming an op log. On a dying disk those can fail with EIO;
the save must still return, the checkpoint must load, and a CleanupWarning (also logged to the ``luopan`` logger)
must name what could not be tidied. An I/O error *before* the commit point is a luopan error naming the file
(StorageFullError for ENOSPC/EDQUOT), never a bare OSError.
"""

from __future__ import annotations

import errno
import logging
import os
import warnings

import numpy as np
import pytest

import luopan
from luopan.errors import CleanupWarning, LuopanError, StorageError, StorageFullError
from luopan.store.local import TMP_MARK, LocalStore

RUN = "dying"


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32), dtype=np.float32), "step": seed}


class _Faults:
    """os.unlink / os.close that fail with EIO (after doing their work, for close) for chosen files."""

    def __init__(self, monkeypatch, *, unlink=lambda path: False, close=lambda path: False):
        self.real_open, self.real_close, self.real_unlink = os.open, os.close, os.unlink
        self.paths: dict[int, str] = {}
        self.failed: list[str] = []
        self.unlink_fails, self.close_fails = unlink, close
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "close", self.close)
        monkeypatch.setattr(os, "unlink", self.unlink)

    def open(self, path, flags, *args, **kw):
        fd = self.real_open(path, flags, *args, **kw)
        self.paths[fd] = os.fspath(path) if not isinstance(path, int) else ""
        return fd

    def close(self, fd):
        path = self.paths.pop(fd, "")
        self.real_close(fd)
        if path and self.close_fails(path):
            self.failed.append(f"close {path}")
            raise OSError(errno.EIO, "Input/output error")

    def unlink(self, path, *args, **kw):
        p = os.fspath(path)
        if self.unlink_fails(p):
            self.failed.append(f"unlink {p}")
            raise OSError(errno.EIO, "Input/output error", p)
        return self.real_unlink(path, *args, **kw)


def _manifest_temp(path: str) -> bool:
    return TMP_MARK in os.path.basename(path) and f"{os.sep}ckpt{os.sep}" in path


def _cleanup_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CleanupWarning)]


def test_a_temp_file_that_cannot_be_removed_after_the_commit_is_a_warning(tmp_path, monkeypatch, caplog):
    root = str(tmp_path / "repo")
    repo = luopan.open(root)
    repo.save(RUN, 1, _state(1))
    faults = _Faults(monkeypatch, unlink=_manifest_temp)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="luopan"):
        warnings.simplefilter("always")
        info = repo.save(RUN, 2, _state(2))  # returns: the checkpoint is committed
    monkeypatch.undo()
    assert info.step == 2 and any(f.startswith("unlink") for f in faults.failed), faults.failed
    messages = _cleanup_warnings(caught)
    assert any("temporary file" in m and "00000002.json" in m and TMP_MARK in m for m in messages), messages
    assert any("00000002.json" in r.getMessage() for r in caplog.records if r.name == "luopan")
    repo.close()
    fresh = luopan.open(root)
    assert fresh.steps(RUN) == [1, 2]
    assert (fresh.load(RUN, 2)["w"] == _state(2)["w"]).all()
    assert fresh.verify().ok
    fresh.close()


def test_a_failing_close_after_the_write_is_a_warning(tmp_path, monkeypatch):
    root = str(tmp_path / "repo")
    repo = luopan.open(root)
    faults = _Faults(monkeypatch, close=_manifest_temp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repo.save(RUN, 1, _state(1))
    monkeypatch.undo()
    assert any(f.startswith("close") for f in faults.failed), faults.failed
    assert any("closing" in m and "00000001.json" in m for m in _cleanup_warnings(caught)), _cleanup_warnings(caught)
    repo.close()
    with luopan.open(root) as fresh:
        assert (fresh.load(RUN, 1)["w"] == _state(1)["w"]).all()


def test_a_failing_close_after_a_read_keeps_the_bytes(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path / "s"))
    store.put("a/b", b"payload")
    _Faults(monkeypatch, close=lambda path: path.endswith(os.path.join("a", "b")))
    with pytest.warns(CleanupWarning, match="closing .*b after reading"):
        assert store.get("a/b") == b"payload"


def test_put_and_put_if_absent_report_success_when_only_cleanup_fails(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path / "s"))
    _Faults(monkeypatch, unlink=lambda path: TMP_MARK in path, close=lambda path: TMP_MARK in path)
    with pytest.warns(CleanupWarning):
        assert store.put_if_absent("x/1", b"one") is True
    with pytest.warns(CleanupWarning):
        store.put("x/2", b"two")
    monkeypatch.undo()
    assert store.get("x/1") == b"one" and store.get("x/2") == b"two"


@pytest.mark.parametrize("code, expected", [(errno.EIO, StorageError), (errno.ENOSPC, StorageFullError),
                                            (errno.EDQUOT, StorageFullError)])
@pytest.mark.parametrize("call", ["fsync", "writev", "replace", "link", "mkdir"])
def test_errors_before_the_commit_are_typed_and_name_the_file(tmp_path, monkeypatch, call, code, expected):
    store = LocalStore(str(tmp_path / "s"))
    real = getattr(os, call)

    def failing(*args, **kw):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, call, failing)
    for op in (lambda: store.put("new/key", b"data"), lambda: store.put_if_absent("new/other", b"data")):
        try:
            op()
        except OSError as exc:
            assert isinstance(exc, expected) and isinstance(exc, LuopanError), repr(exc)
            assert "new" in str(exc), str(exc)
        else:
            assert call in ("replace", "link"), call  # put_if_absent does not rename; put does not link
    monkeypatch.setattr(os, call, real)
    assert not [k for k in store.list("") if TMP_MARK in k]


def test_a_read_error_is_typed_and_names_the_file(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path / "s"))
    store.put("r/k", b"x" * 100)

    def failing(*args, **kw):
        raise OSError(errno.EIO, "Input/output error")

    for call in ("pread", "preadv", "fstat"):
        monkeypatch.setattr(os, call, failing)
        for op in (lambda: store.get_range("r/k", 0, 10), lambda: store.read_into("r/k", 0, memoryview(bytearray(10))),
                   lambda: store.get_limited("r/k", 1000), lambda: store.get("r/k")):
            try:
                op()
            except StorageError as exc:
                assert "r/k" in str(exc)
        monkeypatch.undo()
    monkeypatch.setattr(os, "statvfs", failing)
    assert store.free_bytes() is None  # unknown: the write that follows says what failed


def test_an_artifact_commit_reports_success_when_only_cleanup_fails(tmp_path, monkeypatch):
    root = str(tmp_path / "repo")
    repo = luopan.open(root)
    art = repo.artifact("data")
    faults = _Faults(monkeypatch, unlink=lambda p: TMP_MARK in os.path.basename(p) and "_v" in p)
    with pytest.warns(CleanupWarning, match="temporary file"):
        version = art.commit({"a.txt": b"hello", "b/c.bin": b"\x00" * 100})
    monkeypatch.undo()
    assert faults.failed and version.version == 1
    with art.open("a.txt") as f:
        assert f.read() == b"hello"
    assert art.verify() >= 1
    repo.close()


def test_an_index_snapshot_reports_success_when_the_op_log_cannot_be_trimmed(tmp_path, monkeypatch):
    faiss = pytest.importorskip("faiss")
    from luopan.index import IndexStore
    from luopan.index.oplog import OpLog

    root = str(tmp_path / "repo")
    repo = luopan.open(root)
    store = IndexStore(repo, "vecs")
    rng = np.random.default_rng(0)
    index = faiss.IndexFlatL2(8)
    index.add(rng.standard_normal((50, 8), dtype=np.float32))
    assert store.snapshot(index) == 1

    def dying(self, seq):
        raise StorageError(errno.EIO, "cannot trim the op log: Input/output error")

    monkeypatch.setattr(OpLog, "drop_before", dying)
    index.add(rng.standard_normal((5, 8), dtype=np.float32))
    with pytest.warns(CleanupWarning, match="op log could not be trimmed"):
        assert store.snapshot(index) == 2
    monkeypatch.undo()
    assert store.current() == 2 and store.load().ntotal == 55
    repo.close()

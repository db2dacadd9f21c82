"""Local repositories lock with flock (docs/format.md §9.2): a save writes no lock record, prune/gc still exclude
every save (flock or record), a killed holder's lock is gone with it, and the record protocol still rules where a
record is in the way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import luopan
from luopan.errors import LockedError
from luopan.repository.locks import list_locks, locked
from luopan.store.flocks import filesystem_type, flock_holders, lock_file_for
from luopan.store.local import LocalStore

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _holder(root: str, kind: str, records: bool = False) -> subprocess.Popen[str]:
    """A process holding a ``kind`` lock on the repository at ``root`` until killed; it prints 'held' once held."""
    code = textwrap.dedent(f"""
        import sys, time
        from luopan.repository.locks import locked
        from luopan.store.local import LocalStore
        with locked(LocalStore({root!r}), {kind!r}, "test holder", timeout=30):
            print("held", flush=True)
            time.sleep(120)
    """)
    env = dict(os.environ, PYTHONPATH=SRC)
    if records:
        env["LUOPAN_LOCK_RECORDS"] = "1"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(30)


def test_local_repositories_use_flock(tmp_path):
    assert filesystem_type(str(tmp_path)) is not None
    repo = luopan.open(tmp_path / "r")
    path = repo.repository.store.lock_path()
    assert path == str(tmp_path / "r" / "locks" / "flock")
    assert lock_file_for(str(tmp_path)) is not None


def test_a_save_writes_no_lock_record(tmp_path, monkeypatch):
    repo = luopan.open(tmp_path / "r")
    store = repo.repository.store
    puts: list[str] = []
    real_put = type(store).put

    def put(self, key, data):
        puts.append(key)
        return real_put(self, key, data)

    monkeypatch.setattr(type(store), "put", put)
    repo.save("a", 1, {"x": np.arange(10.0)})
    assert not [k for k in puts if k.startswith("locks/")]
    assert list_locks(store) == []
    np.testing.assert_array_equal(repo.load("a", 1)["x"], np.arange(10.0))


def test_gc_waits_for_a_save_holding_flock_and_names_it(tmp_path):
    repo = luopan.open(tmp_path / "r", lock_timeout=0.3)
    repo.save("a", 1, {"x": np.ones(4)})
    p = _holder(str(tmp_path / "r"), "shared")
    try:
        assert flock_holders(str(tmp_path / "r" / "locks" / "flock")) == [p.pid]
        with pytest.raises(LockedError, match=rf"a save is running \(process {p.pid} holds"):
            repo.gc(grace=0)
        assert list_locks(repo.repository.store) == []  # gc took its record back
    finally:
        _stop(p)
    assert repo.gc(grace=0) is not None  # the killed holder's flock went with it: no stale lock to break


def test_a_save_waits_for_gc(tmp_path):
    root = str(tmp_path / "r")
    repo = luopan.open(root, lock_timeout=0.3)
    p = _holder(root, "exclusive")
    try:
        with pytest.raises(LockedError):
            repo.save("a", 1, {"x": np.ones(4)})
        assert repo.steps("a") == []
    finally:
        _stop(p)
    # the killed gc left its record; the save removes it (its holder is gone) and proceeds
    with pytest.warns(UserWarning, match="removed a stale repository lock"):
        repo.save("a", 1, {"x": np.ones(4)})
    assert repo.steps("a") == [1]


def test_an_exclusive_record_without_flock_still_stops_saves(tmp_path):
    """A process locking with records only (an older luopan, or LUOPAN_LOCK_RECORDS=1) holding gc's lock: a save
    sees its record and waits for it."""
    root = str(tmp_path / "r")
    repo = luopan.open(root, lock_timeout=0.3)
    p = _holder(root, "exclusive", records=True)
    try:
        assert [r.kind for r in list_locks(LocalStore(root))] == ["exclusive"]
        with pytest.raises(LockedError, match="exclusive lock"):
            repo.save("a", 1, {"x": np.ones(4)})
    finally:
        _stop(p)


def test_exclusive_waits_for_shared_in_the_same_process(tmp_path):
    """flock locks belong to an open file, not a process: a save on one thread holds off gc on another."""
    store = LocalStore(tmp_path / "r")
    store.put("x", b"1")
    order: list[str] = []
    with locked(store, "shared", "save"):
        def gc() -> None:
            with locked(store, "exclusive", "gc", timeout=10):
                order.append("gc")

        t = threading.Thread(target=gc)
        t.start()
        time.sleep(0.3)
        order.append("save done")
    t.join(15)
    assert order == ["save done", "gc"]


def test_the_lock_file_need_not_survive(tmp_path):
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"x": np.ones(4)})
    os.unlink(tmp_path / "r" / "locks" / "flock")  # as after a power cut before its directory was synced
    repo.save("a", 2, {"x": np.zeros(4)})
    assert repo.steps("a") == [1, 2]
    assert (tmp_path / "r" / "locks" / "flock").exists()


def test_records_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("LUOPAN_LOCK_RECORDS", "1")
    store = LocalStore(tmp_path / "r")
    assert store.lock_path() is None
    with locked(store, "shared", "save"):
        assert [r.kind for r in list_locks(store)] == ["shared"]
    assert list_locks(store) == []


def test_a_killed_shared_holder_never_blocks(tmp_path):
    root = str(tmp_path / "r")
    LocalStore(root).put("x", b"1")
    p = _holder(root, "shared")
    with pytest.raises(LockedError):
        with locked(LocalStore(root), "exclusive", "gc", timeout=0.2):
            pass
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    with locked(LocalStore(root), "exclusive", "gc", timeout=0.5):
        assert flock_holders(os.path.join(root, "locks", "flock")) == [os.getpid()]

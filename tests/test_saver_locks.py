"""`LuopanSaver` never stalls an agent on a repository lock another process holds (issue 27 item 13): the automatic
compaction after a delete is tried without waiting and put off while the lock is busy; the delete stays applied and
durable, later calls go on, and the compaction happens once the lock is free."""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("langgraph.checkpoint.base", reason="langgraph-checkpoint is not installed")

import luopan
from luopan.langgraph import LuopanSaver

from .conftest import PYTHON
from .test_langgraph_saver import cfg, put_chain

store_module = importlib.import_module("luopan.langgraph.store")

HOLDER = """
import sys
import luopan
from luopan.repository.locks import acquire
repo = luopan.open(sys.argv[1], create=False)
lock = acquire(repo.store, sys.argv[2], "the test's other process", timeout=60)
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
lock.release()
"""


class Holder:
    """A second process holding a repository lock of ``kind`` until ``release``."""

    def __init__(self, repo: str, kind: str, env: dict) -> None:
        self.proc = subprocess.Popen([PYTHON, "-c", HOLDER, repo, kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)
        line = self.proc.stdout.readline()
        assert line == "held\n", f"the holder did not take its lock (exit {self.proc.poll()})"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def no_pause(monkeypatch):
    """Deferred compaction is retried by the very next write (no wall-clock pause to wait out in a test)."""
    monkeypatch.setattr(store_module, "COMPACT_RETRY_SECONDS", 0.0, raising=False)


def open_saver(path: str) -> LuopanSaver:
    # a bounded lock_timeout: a saver that waited for the lock would fail this test after 3 s instead of hanging
    return LuopanSaver(luopan.open(path, lock_timeout=3), fsync="always", compact_min_dead_bytes=1 << 14,
                       segment_bytes=1 << 15)


@pytest.mark.parametrize("kind", ["shared", "exclusive"])
def test_a_lock_held_by_another_process_does_not_stall_deletes_or_later_calls(tmp_path, child_env, no_pause, kind):
    path = str(tmp_path / "repo")
    saver = open_saver(path)
    for t in range(6):
        put_chain(saver, f"t{t}", 12, tag=f"t{t}")
    kept = saver.get_tuple(cfg("t5")).checkpoint
    holder = Holder(path, kind, child_env)
    try:
        for t in range(3):
            saver.delete_thread(f"t{t}")  # no LockedError: the compaction is put off
            assert saver.get_tuple(cfg(f"t{t}")) is None
        assert getattr(saver._store, "deferred", None) == ("compact" if kind == "exclusive" else "prune")
        attempts = []
        real = saver._store._compact_without_waiting
        saver._store._compact_without_waiting = lambda: (attempts.append(1), real())[1]
        put_chain(saver, "new", 3, tag="new")  # later calls go on, each trying once more without waiting
        assert saver._store.deferred is not None and len(attempts) == 3
        saver.close()
        # the deletes are durable: a new saver (another Repo object) sees them, the lock still held
        saver = open_saver(path)
        assert [saver.get_tuple(cfg(f"t{t}")) for t in range(3)] == [None] * 3
        assert saver.get_tuple(cfg("t5")).checkpoint == kept and saver.get_tuple(cfg("new")) is not None
        saver.delete_thread("t3")
        assert saver.get_tuple(cfg("t3")) is None
    finally:
        holder.release()
    # the lock is free: the next write does the deferred work
    put_chain(saver, "after", 1, tag="after")
    assert saver._store.deferred is None and len(saver.journal.snapshots()) == 1
    saver.close()
    with LuopanSaver(path) as again:
        assert [again.get_tuple(cfg(f"t{t}")) for t in range(4)] == [None] * 4
        assert again.get_tuple(cfg("t5")).checkpoint == kept


def test_retries_are_spaced_while_the_lock_stays_busy(tmp_path, child_env, monkeypatch):
    """Without the test's override, a busy lock is tried again only after COMPACT_RETRY_SECONDS, doubling: a write
    in between does not even look at the locks."""
    clock = [1000.0]
    monkeypatch.setattr(store_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    path = str(tmp_path / "repo")
    saver = open_saver(path)
    for t in range(6):
        put_chain(saver, f"t{t}", 12, tag=f"t{t}")
    holder = Holder(path, "exclusive", child_env)
    try:
        compacts = []
        real = saver._store.journal.compact
        saver._store.journal.compact = lambda *a, **k: (compacts.append(1), real(*a, **k))[1]
        t = 0
        while saver._store.deferred is None:
            saver.delete_thread(f"t{t}")
            t += 1
        assert compacts == [1] and saver._store.deferred == "compact"
        saver.delete_thread(f"t{t}")  # within the pause, neither a delete…
        put_chain(saver, "x", 2, tag="x")  # …nor a write tries again
        assert compacts == [1]
        clock[0] += store_module.COMPACT_RETRY_SECONDS + 0.5
        put_chain(saver, "y", 1, tag="y")  # past it: one more try, and the pause doubles
        assert compacts == [1, 1]
        clock[0] += store_module.COMPACT_RETRY_SECONDS + 0.5
        put_chain(saver, "y2", 1, tag="y2")
        assert compacts == [1, 1]
        clock[0] += store_module.COMPACT_RETRY_SECONDS
        put_chain(saver, "y3", 1, tag="y3")
        assert compacts == [1, 1, 1] and saver._store.deferred == "compact"
    finally:
        holder.release()
    clock[0] += store_module.COMPACT_RETRY_MAX_SECONDS + 1
    put_chain(saver, "z", 1, tag="z")
    assert saver._store.deferred is None and len(saver.journal.snapshots()) == 1 and len(compacts) == 4
    saver.close()


def test_an_explicit_compact_still_waits_and_reports_a_busy_lock(tmp_path, child_env):
    path = str(tmp_path / "repo")
    saver = LuopanSaver(luopan.open(path, lock_timeout=0.2), fsync="off")
    put_chain(saver, "t", 3)
    holder = Holder(path, "exclusive", child_env)
    try:
        with pytest.raises(luopan.LockedError):
            saver.compact()
        assert saver.get_tuple(cfg("t")) is not None
    finally:
        holder.release()
    saver.compact()
    assert len(saver.journal.snapshots()) == 1
    saver.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

"""Power loss during the write paths built on the log (tests/powerloss.py, docs/format.md §10.6 and §16): journal
appends and compaction, the LangGraph saver's puts, writes, prune and compaction, and an index's snapshot, op log
and rollback.

Each test builds a repository, records one operation's file operations, and checks every crash state the durability
model allows (up to ``LUOPAN_POWERLOSS_STATES`` per operation): the repository and the journal / saver / index open;
everything committed before the operation reads back exactly; what was in flight is wholly there or wholly absent;
and every acknowledged record, put and index op (``rec.ack`` right after the call returned) is there.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import luopan
from luopan.journal import Journal

from .crashstates import CrashState, check_crash_states
from .helpers import assert_exact
from .powerloss import Recorder

SEGMENT = 4096  # the smallest segment: appends rotate and compaction drops whole segments with little data
PRE = {"w": np.arange(300, dtype=np.float32), "meta": {"step": 1}}  # a checkpoint beside the logs, never touched


def record(world, op):
    with Recorder(world) as rec:
        op(rec)
    return rec


def make_repo(root):
    with luopan.open(root, progress=False) as r:
        r.save("r", 1, PRE)


def check_repo(root):
    """The repository opens and the checkpoint saved before the operation loads bit for bit."""
    with luopan.open(root, create=False, progress=False) as r:
        assert_exact(r.load("r", step=1), PRE)


def item(i: int, tag: str = "", pad: int = 90) -> dict:
    return {"i": i, "tag": tag, "pad": "x" * pad}


def acked(state: CrashState, name: str) -> int:
    """How many records of journal ``name`` were acknowledged before the crash (acks are (name, seq))."""
    seqs = [label[1] for label in state.acks if isinstance(label, tuple) and label[0] == name]
    return max(seqs) + 1 if seqs else 0


def history(j: Journal) -> list:
    """Every record of a journal, the ones compacted away read from the latest snapshot (whose value is
    ``{"records": [...]}``, the records it stands for)."""
    snap = j.latest_snapshot()
    out = list(snap.value["records"]) if snap is not None else []
    assert len(out) == (snap.seq if snap is not None else 0)
    assert j.first_seq <= len(out)
    return out + list(j.read(len(out)))


# -- journals -----------------------------------------------------------------------------------------------------
def test_journal_appends(tmp_path):
    """``fsync="always"`` appends (rotating segments) and an ``append_many`` into a journal that exists; a new
    journal (its directories made by the operation) in ``"batch"`` mode, acknowledged only after ``sync()`` and
    ``close()``: a batch append returns before its record is synced, by design (group commit), so it is not
    acknowledged as durable when it returns."""
    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    main = [item(i, "pre") for i in range(10)]
    with Journal(root, name="main", segment_bytes=SEGMENT) as j:
        for r in main:
            j.append(r)
    main += [item(i) for i in range(40)] + [item(i, "many") for i in range(5)]
    fresh = [item(i, "fresh") for i in range(5)]

    def op(rec):
        with Journal(root, fsync="always", name="main", segment_bytes=SEGMENT) as j:
            for r in main[10:50]:
                rec.ack(("main", j.append(r)))
            seqs = j.append_many(main[50:])
            rec.ack(("main", seqs[-1]))
        b = Journal(root, fsync="batch", name="fresh", batch_records=1000, batch_ms=3_600_000)
        for r in fresh[:3]:
            b.append(r)  # not acknowledged: in "batch" mode it is durable only at the next sync
        b.sync()
        rec.ack(("fresh", 2))
        for r in fresh[3:]:
            b.append(r)
        b.close()  # close syncs ("batch" and "always" modes)
        rec.ack(("fresh", 4))

    rec = record(world, op)
    segments = [n for n in os.listdir(root / "journals" / "main" / "log") if n.endswith(".seg")]
    assert len(segments) >= 3, segments  # the appends rotated segments twice
    assert check_crash_states(rec, tmp_path, _journals_check({"main": (main, 10), "fresh": (fresh, 0)})) > 20


def test_journal_writer_after_an_unsynced_one(tmp_path):
    """A writer in ``fsync="off"`` mode appends and goes (closing does not sync in that mode; nothing of it is
    acknowledged), and the next writer appends in ``"always"`` mode: its first acknowledged record vouches for the
    ones before it, so those must be durable first (the new writer syncs the tail it opens). The unsynced records
    span pages, so a crash can keep a later page and lose theirs."""
    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    main = [item(i, "pre") for i in range(10)]
    with Journal(root, name="main") as j:
        for r in main:
            j.append(r)
    main += [item(i, "off", 2000) for i in range(5)] + [item(i) for i in range(3)]

    def op(rec):
        with Journal(root, fsync="off", name="main") as j:
            for r in main[10:15]:
                j.append(r)
        with Journal(root, fsync="always", name="main") as j:
            for r in main[15:]:
                rec.ack(("main", j.append(r)))

    rec = record(world, op)
    assert check_crash_states(rec, tmp_path, _journals_check({"main": (main, 10)})) > 20


def _journals_check(journals: dict[str, tuple[list, int]]):
    """A check that each journal (name -> (every record appended, how many were there before the operation))
    opens, holds a prefix of its records no shorter than what was there before and what was acknowledged, and
    takes appends again."""

    def check(state):
        repo_root = os.path.join(state.root, "repo")
        check_repo(repo_root)
        for name, (want, before) in journals.items():
            with Journal(repo_root, name=name, segment_bytes=SEGMENT) as j:
                got = list(j.read())
                assert got == want[:len(got)], f"journal {name}: records differ from what was appended"
                assert len(got) >= max(acked(state, name), before), \
                    f"journal {name}: {len(got)} records, {acked(state, name)} were acknowledged"
                assert j.append({"after": 1}) == len(got)  # the journal takes appends again

    return check


def test_journal_compaction(tmp_path):
    """``compact`` (a snapshot in the repository, then the covered segments unlinked) over a log of several
    segments with an older snapshot, more appends, then ``prune`` of the older snapshot. In every state the journal
    opens (no gap between the snapshot and the log), and snapshot + log give back every acknowledged record."""
    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    records = [item(i, "pre") for i in range(80)]
    with Journal(root, name="main", segment_bytes=SEGMENT) as j:
        for r in records[:30]:
            j.append(r)
        j.compact({"records": records[:30]})
        for r in records[30:]:
            j.append(r)
        assert j.first_seq > 0
    old_snapshot = {"records": records[:30]}
    records += [item(i) for i in range(3)]

    def op(rec):
        with Journal(root, name="main", segment_bytes=SEGMENT) as j:
            assert j.compact({"records": records[:80]}) == 80
            rec.ack("compacted")
            for i in range(80, 83):
                rec.ack(("main", j.append(records[i])))
            plan = j.prune(keep_last=1)
            assert plan.remove == [30], plan
            rec.ack("pruned")

    log = root / "journals" / "main" / "log"
    before = sorted(n for n in os.listdir(log) if n.endswith(".seg"))
    rec = record(world, op)
    after = sorted(n for n in os.listdir(log) if n.endswith(".seg"))
    assert len(before) - len(after) >= 2, (before, after)  # the compaction unlinked segments, one by one

    def check(state):
        repo_root = os.path.join(state.root, "repo")
        check_repo(repo_root)
        with Journal(repo_root, name="main", segment_bytes=SEGMENT) as j:
            got = history(j)
            assert got == records[:len(got)]
            assert len(got) >= max(80, acked(state, "main"))
            snaps = j.snapshots()
            if "compacted" in state.acks:
                assert 80 in snaps
            if 30 in snaps:
                assert j.load_snapshot(30).value == old_snapshot
            else:
                assert 80 in snaps, "the older snapshot went before the newer one was committed"
            if "pruned" in state.acks:
                assert snaps == [80]
            assert j.append({"after": 1}) == len(got)

    assert check_crash_states(rec, tmp_path, check) > 20


# -- the LangGraph saver ------------------------------------------------------------------------------------------
def _cfg(thread: str, cid: str | None = None) -> dict:
    c: dict = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    if cid:
        c["configurable"]["checkpoint_id"] = cid
    return c


def _put_chain(saver, thread: str, steps: int, ack=None) -> list[str]:
    """A growing list channel, one new item per checkpoint, each put acknowledged (``ack(cid)``) when it returns."""
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

    ids, items, parent, ck = [], [], None, empty_checkpoint()
    for step in range(steps):
        items = items + [f"{thread}{step}:" + "y" * 150]
        version = saver.get_next_version(ck["channel_versions"].get("items"), None)
        ck["channel_versions"] = {**ck["channel_versions"], "items": version}
        ck["channel_values"] = {"items": items, "step": step}
        ck = create_checkpoint(ck, None, step)
        stored = saver.put(_cfg(thread, parent), ck, {"source": "loop", "step": step}, {"items": version})
        parent = stored["configurable"]["checkpoint_id"]
        ids.append(parent)
        if ack is not None:
            ack(parent)
    return ids


def _tuple(saver, thread: str, cid: str):
    t = saver.get_tuple(_cfg(thread, cid))
    return None if t is None else (t.checkpoint, t.metadata, t.parent_config, t.pending_writes)


def test_langgraph_saver_puts_prune_and_compaction(tmp_path):
    """``fsync="always"`` puts and a ``put_writes`` (each durable when it returns), then ``prune`` of an older
    thread (one record) and an explicit ``compact`` (a snapshot, the covered segments unlinked, the older snapshot
    pruned). In every state the saver opens, the checkpoint the prune keeps reads back exactly, each put is wholly
    there (exactly) or absent, and every acknowledged one is there."""
    pytest.importorskip("langgraph.checkpoint.base", reason="langgraph-checkpoint is not installed")
    from luopan.langgraph import LuopanSaver

    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    with LuopanSaver(str(root), segment_bytes=SEGMENT) as saver:
        old = _put_chain(saver, "a", 6)
        saver.compact()  # an older snapshot, which the compaction of the operation prunes
        before = {cid: _tuple(saver, "a", cid) for cid in old}
    expected: dict[str, tuple] = {}  # cid -> (thread, tuple)
    writes = [("items", "w0"), ("step", 99)]

    def op(rec):
        with LuopanSaver(str(root), segment_bytes=SEGMENT) as saver:
            def ack(cid):
                expected[cid] = ("b", _tuple(saver, "b", cid))
                rec.ack(("put", cid))
            new = _put_chain(saver, "b", 8, ack)
            saver.put_writes(_cfg("b", new[-1]), writes, "task-1")
            rec.ack("writes")
            expected["writes"] = ("b", _tuple(saver, "b", new[-1]))
            assert expected["writes"][1][3] == [("task-1", "items", "w0"), ("task-1", "step", 99)]
            saver.prune(["a"], keep_last=1)
            rec.ack("pruned")
            assert saver.get_tuple(_cfg("a", old[0])) is None
            seq = saver.compact()
            rec.ack("compacted")
            assert saver.journal.snapshots() == [seq]
            assert saver.journal.first_seq > 0  # the compaction dropped log segments

    rec = record(world, op)
    assert len(expected) == 9

    def check(state):
        repo_root = os.path.join(state.root, "repo")
        check_repo(repo_root)
        with LuopanSaver(repo_root, segment_bytes=SEGMENT) as saver:
            assert _tuple(saver, "a", old[-1]) == before[old[-1]]  # kept by the prune
            for cid in old[:-1]:
                got = _tuple(saver, "a", cid)
                assert got in (None, before[cid]), f"pruned checkpoint {cid} came back changed"
                if "pruned" in state.acks:
                    assert got is None, f"checkpoint {cid} was pruned (acknowledged) and came back"
            for cid, (thread, want) in expected.items():
                if cid == "writes":
                    continue
                got = _tuple(saver, thread, cid)
                if ("put", cid) in state.acks:
                    assert got is not None, f"put {cid} was acknowledged and is gone"
                if got is not None and cid == expected["writes"][1][0]["id"]:
                    assert got in (want, expected["writes"][1]), f"put {cid} came back changed"
                    if "writes" in state.acks:
                        assert got == expected["writes"][1], "acknowledged pending writes are gone"
                else:
                    assert got in (None, want), f"put {cid} came back changed"

    assert check_crash_states(rec, tmp_path, check) > 20


# -- index snapshots ----------------------------------------------------------------------------------------------
D = 8


def _index_state(index) -> tuple[bytes, bytes]:
    """An IndexIDMap2(IndexFlatL2)'s ids and vectors, as bytes: equal states search alike."""
    import faiss

    n = index.ntotal
    return faiss.vector_to_array(index.id_map).astype("<i8").tobytes(), index.index.reconstruct_n(0, n).tobytes()


def test_index_snapshot_ops_and_rollback(tmp_path):
    """``log_add`` / ``log_remove`` (``fsync="always"``: durable when they return), a ``snapshot`` (packs, manifest,
    current ref, then the op log trimmed) and a ``rollback`` (the current ref rewritten). In every state the
    repository opens, version 1 loads exactly, version 2 is wholly there or absent, and ``load()`` (the live version
    with its ops replayed) is the state after the last acknowledged call or after a later one — never an older
    one, never a mix."""
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(5)

    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    index = faiss.IndexIDMap2(faiss.IndexFlatL2(D))
    index.add_with_ids(rng.standard_normal((40, D)).astype("float32"), np.arange(40) + 100)
    more = rng.standard_normal((7, D)).astype("float32")
    with luopan.open(root, progress=False) as r, luopan.index.IndexStore(r, "kb") as idx:
        assert idx.snapshot(index) == 1
        v1 = _index_state(idx.load(1))
        idx.log_add(np.array([700]), more[6:])  # an op logged before the operation
        states = [_index_state(idx.load())]  # the live state after each acknowledged call ([0]: before)

    def op(rec):
        with luopan.open(root, progress=False) as r, luopan.index.IndexStore(r, "kb") as idx:
            def ack(label):
                states.append(_index_state(idx.load()))
                rec.ack(label)
            idx.log_add(np.arange(3) + 900, more[:3])
            ack("add")
            idx.log_remove(np.array([100, 101]))
            ack("remove")
            assert idx.snapshot(idx.load()) == 2
            ack("snapshot")
            idx.log_add(np.arange(3) + 950, more[3:6])
            ack("add-2")
            idx.rollback(1)
            ack("rollback")
            idx.log_remove(np.array([102]))
            ack("remove-2")

    rec = record(world, op)
    assert states[3] == states[2], "a snapshot of the loaded index changes nothing live"
    assert states[5] == v1, "a rollback makes the version live without the ops logged against it before"
    assert len(set(states)) == 6  # so the live state tells how many calls took effect (the snapshot aside)
    v2 = states[3]

    def check(state):
        repo_root = os.path.join(state.root, "repo")
        check_repo(repo_root)
        with luopan.open(repo_root, create=False, progress=False) as r, luopan.index.IndexStore(r, "kb") as idx:
            versions = idx.versions()
            assert versions in ([1], [1, 2]), versions
            assert _index_state(idx.load(1)) == v1
            if 2 in versions:
                assert _index_state(idx.load(2)) == v2
            if "snapshot" in state.acks:
                assert 2 in versions, "the acknowledged snapshot is gone"
            live = _index_state(idx.load())
            done = len(state.acks)
            assert live in states[done:], (f"the live index is not the state after {done} acknowledged calls nor "
                                           f"a later one (it is the state after {states.index(live)})"
                                           if live in states else "the live index is no state the calls made")
            n = idx.load().ntotal
            idx.log_add(np.array([5000]), more[:1])  # the op log takes appends again
            assert idx.load().ntotal == n + 1

    assert check_crash_states(rec, tmp_path, check) > 20


# -- several writers (docs/format.md §16.2) -------------------------------------------------------------------------
class Killed(Exception):
    """A writer dying in the middle of a write (its process gone: no undo, its locks released)."""


def _kill(j: Journal) -> None:
    """What the death of the process holding ``j`` leaves: its files closed as they are (nothing synced, nothing
    cut), its locks released."""
    log = j._log
    if log._fd is not None:
        os.close(log._fd)
        log._fd = None
    log._closed = True
    log._release_lock()
    j.repo.close()


def test_two_shared_writers_one_killed_mid_append(tmp_path):
    """Two writers of one shared journal (``shared=True``) interleave ``fsync="always"`` appends across segment
    rotations; one dies half-way through writing a frame (holding the append lock); the other goes on appending
    (the first of its appends cuts the torn frame). In every crash state the journal opens, holds the records in the
    order they were appended, the dead writer's half frame never among them, and every acknowledged record of
    either writer is there."""
    from unittest import mock

    from luopan.repository import wal

    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    want = [item(i, "pre") for i in range(10)]
    with Journal(root, name="main", shared=True, segment_bytes=SEGMENT) as j:
        for r in want:
            j.append(r)

    def op(rec):
        a = Journal(root, name="main", shared=True, segment_bytes=SEGMENT)
        k = Journal(root, name="main", shared=True, segment_bytes=SEGMENT)
        for i in range(15):
            for who, j in (("a", a), ("k", k)):
                want.append(item(i, who))
                rec.ack(("main", j.append(want[-1])))
        real = wal._write

        def half(fd, data, path):
            if len(data) <= 32:  # a new segment's header (the append rotates first): written whole
                return real(fd, data, path)
            real(fd, data[: len(data) // 2], path)
            raise Killed()

        with mock.patch.object(wal, "_write", half), pytest.raises(Killed):
            k.append(item(99, "dead", 3000))
        _kill(k)
        for i in range(15, 30):
            want.append(item(i, "a"))
            rec.ack(("main", a.append(want[-1])))
        assert len(a.recovered) == 1  # the torn frame, cut by the next writer
        a.close()

    rec = record(world, op)
    assert check_crash_states(rec, tmp_path, _journals_check({"main": (want, 10)})) > 20


def test_two_savers_interleaving_with_compaction(tmp_path):
    """Two LuopanSavers on one repository (as two worker processes would be) put in turn; one prunes its thread
    and compacts (a snapshot, the covered segments unlinked) while the other keeps putting, and reads the other's
    checkpoints after. In every crash state the saver opens, every acknowledged put of either is there and reads
    back exactly, and nothing put comes back changed."""
    pytest.importorskip("langgraph.checkpoint.base", reason="langgraph-checkpoint is not installed")
    from luopan.langgraph import LuopanSaver

    world = tmp_path / "w"
    root = world / "repo"
    make_repo(root)
    expected: dict[str, tuple] = {}

    def op(rec):
        one = LuopanSaver(str(root), segment_bytes=SEGMENT)
        two = LuopanSaver(str(root), segment_bytes=SEGMENT)

        def acker(saver, thread):
            def ack(cid):
                expected[cid] = (thread, _tuple(saver, thread, cid))
                rec.ack(("put", cid))
            return ack

        _put_chain(one, "one", 4, acker(one, "one"))
        _put_chain(two, "two", 4, acker(two, "two"))
        one.prune(["one"], keep_last=1)
        rec.ack("pruned")
        one.compact()
        rec.ack("compacted")
        _put_chain(two, "three", 4, acker(two, "three"))
        for cid, (thread, want) in list(expected.items()):  # each sees the other's puts, the prune included
            for s in (one, two):
                got = _tuple(s, thread, cid)
                assert got == want or (thread == "one" and got is None)
        one.close()
        two.close()

    rec = record(world, op)

    def check(state):
        repo_root = os.path.join(state.root, "repo")
        check_repo(repo_root)
        with LuopanSaver(repo_root, segment_bytes=SEGMENT) as saver:
            newest_one = max((c for c, (t, _w) in expected.items() if t == "one"))
            for cid, (thread, want) in expected.items():
                got = _tuple(saver, thread, cid)
                if thread == "one" and cid != newest_one:  # pruned (the prune may be there before its ack)
                    assert got in (None, want), f"put {cid} came back changed"
                    if "pruned" in state.acks:
                        assert got is None, f"checkpoint {cid} was pruned (acknowledged) and came back"
                elif ("put", cid) in state.acks:
                    assert got == want, f"put {cid} was acknowledged and is gone or changed"
                else:
                    assert got in (None, want), f"put {cid} came back changed"

    assert check_crash_states(rec, tmp_path, check) > 20

"""Fault injection at every I/O call of every write path (issue 27; tests/faults.py).

For each operation — a full save, a row-delta save with segments, an XOR-delta save, a save with entry groups, a
collective save, gc with repack, prune/rm, an artifact commit and an in-place checkout, journal appends and a compaction, LangGraph puts and
a prune, an index snapshot and a rollback, a publish, a pull (a patch applied into the output), ``patch apply`` and
``upgrade`` — the test counts the ``write``, ``fsync``, ``rename`` and ``mkdir`` calls it makes, then, on a fresh copy
of the same starting state each time, fails the n-th call of one kind with EIO, ENOSPC or EDQUOT (the errno cycles
with n, so every kind meets every errno). Each failure must be

* one luopan error — StorageFullError for ENOSPC/EDQUOT, StorageError for EIO, carrying that errno — whose message
  names the file or the repository concerned and says what to do;

and afterwards, without faults,

* everything committed before (and everything the operation acknowledged before it failed) is there, bit for bit,
  and the repository (journal, channel, device…) opens;
* the operation run again succeeds, and its result loads exactly.

By default every call is failed once, with the errno cycling (every call kind meets every errno);
``LUOPAN_FAULTS_ALL=1`` (``make test-slow``) fails every call with every errno, and every call again with it and every
later call of its kind failing too (a disk that stays full: the clean-up after the failure meets it as well).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import luopan

from .faults import CALLS, ERRNOS, Faults
from .helpers import assert_exact, assert_lora_loads, config_version, data_module

FAULTS_ALL = os.environ.get("LUOPAN_FAULTS_ALL", "") not in ("", "0")  # make test-slow
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHUNK = 16 << 10
POLICY = luopan.DeltaPolicy(min_bytes=64 << 10, xor_min_bytes=64 << 10)
FULL = (errno.ENOSPC, errno.EDQUOT)
# what a message says to do: a remedy (free space, check the disk), then what to run again
REMEDY = re.compile(r"free space|raise the quota|check the disk", re.IGNORECASE)
RETRY = re.compile(r"again|retry|reopen", re.IGNORECASE)
# Calls whose failure after the commit loses nothing and needs no warning: removing a lock record (a stale one is
# removed by the next writer) and the journal's sync mark (evidence only: a stale mark is still true).
SILENT = r"(^|/)locks(/|$)|(^|/)DURABLE$"


def open_repo(path, **kw):
    return luopan.open(path, chunk_size=CHUNK, pack_size=64 << 10, delta_policy=POLICY, progress=False, **kw)


def table(seed, rows=1024, dim=64):
    return np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)


def steps_of(repo, run):
    try:
        return set(repo.steps(run))
    except luopan.CheckpointNotFoundError:
        return set()


# -- the operations ----------------------------------------------------------------------------------------------
@dataclass
class Operation:
    """One write path. ``build(world)`` makes the starting state (once; each case gets a copy); ``run(world, acked)``
    performs the operation, appending to ``acked`` what it acknowledged to its caller (a retry continues from
    there); ``check(world, acked, complete)`` asserts what must hold afterwards: everything committed before and
    ``acked`` exactly there, the operation's result wholly there or absent — and there when ``complete``. ``root``
    (under the world) is the location a message must name when it names no file of its own."""

    name: str
    build: Callable[[str], Any]
    run: Callable[[str, list], Any]
    check: Callable[[str, list, bool], Any]
    root: str = "repo"
    silent: str | None = None  # paths (a regex) whose failure this operation may absorb without a word
    requires: str | None = None  # an optional module the operation needs (skipped without it)


OPERATIONS: dict[str, Operation] = {}


def operation(name, root="repo", silent=None, requires=None):
    def register(cls):
        obj = cls()
        OPERATIONS[name] = Operation(name, obj.build, obj.run, obj.check, root, silent, requires)
        return cls
    return register


class CheckpointSave:
    """A save of ``new`` as (run, step) into a repository holding ``before``."""

    run_name, step = "r", 2
    compression = None

    def states(self):
        raise NotImplementedError

    def build(self, world):
        before, _new = self.states()
        r = open_repo(os.path.join(world, "repo"), **({"compression": self.compression} if self.compression else {}))
        for (run, step), state in before.items():
            r.save(run, step, state)
        r.close()

    def run(self, world, acked):
        _before, new = self.states()
        r = open_repo(os.path.join(world, "repo"))
        try:
            r.save(self.run_name, self.step, new)
            acked.append((self.run_name, self.step))
        finally:
            r.close()

    def check(self, world, acked, complete):
        before, new = self.states()
        r = open_repo(os.path.join(world, "repo"))
        try:
            for (run, step), state in before.items():
                assert_exact(r.load(run, step=step), state)
            key = (self.run_name, self.step)
            present = self.step in steps_of(r, self.run_name)
            if complete or key in acked:
                assert present, f"{key} was acknowledged and is not there"
            if present:
                assert_exact(r.load(*key), new)
            r.verify()
        finally:
            r.close()


@operation("full_save")
class FullSave(CheckpointSave):
    def states(self):
        s1 = {"w": table(1), "shared": np.arange(5000.0), "meta": {"step": 1, "name": "é"}}
        s2 = {"w": table(2), "shared": np.arange(5000.0), "meta": {"step": 2, "name": "é"}}
        return {("r", 1): s1}, s2


@operation("row_delta_save")
class RowDeltaSave(CheckpointSave):
    run_name, step = "emb", 3

    def states(self):
        emb = table(0, 2048, 64)  # 512 KiB: a row-delta candidate under POLICY
        rng = np.random.default_rng(1)
        before = {}
        for step in range(3):
            if step:
                emb[rng.choice(len(emb), 12, replace=False)] += 1
            before[("emb", step)] = {"emb": emb.copy()}
        emb[rng.choice(len(emb), 12, replace=False)] += 1
        return before, {"emb": emb.copy()}

    def run(self, world, acked):
        super().run(world, acked)
        if acked:
            from .test_powerloss import manifest_doc
            delta = manifest_doc(os.path.join(world, "repo"), "emb", 3)["entries"][0]["delta"]
            assert len(delta.get("segments", [])) >= 2, "the save did not append a segment"


@operation("xor_delta_save")
class XorDeltaSave(CheckpointSave):
    run_name, step = "ft", 1
    compression = "zstd"

    def states(self):
        base = {"w": (np.random.default_rng(0).standard_normal(64 << 10) * 0.02).astype(np.float32)}
        moved = {"w": base["w"] + np.float32(1e-6) * np.sign(base["w"])}
        return {("ft", 0): base}, moved

    def run(self, world, acked):
        super().run(world, acked)
        if acked:
            from .test_powerloss import manifest_doc
            assert "xor" in manifest_doc(os.path.join(world, "repo"), "ft", 1)["entries"][0], "not an XOR delta"


@operation("grouped_save")
class GroupedSave(CheckpointSave):
    run_name, step = "g", 2

    def states(self):
        rng = np.random.default_rng(3)
        s0 = {f"layer{i:02d}": rng.standard_normal(64, dtype=np.float32) for i in range(40)}
        s1 = {**s0, "layer00": s0["layer00"] + 1}
        s2 = {**s1, "layer01": s1["layer01"] + 1}
        return {("g", 0): s0, ("g", 1): s1}, s2

    def run(self, world, acked):
        super().run(world, acked)
        if acked:
            from .test_powerloss import manifest_doc
            assert manifest_doc(os.path.join(world, "repo"), "g", 2).get("groups"), "no entry groups"


def _gloo():
    """torch.distributed initialised in this process as a group of one (gloo), once."""
    import torch.distributed as dist
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist


@operation("collective_save")
class CollectiveSave(CheckpointSave):
    run_name, step = "c", 2

    def states(self):
        import torch
        g = torch.Generator().manual_seed(5)
        model = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
        return ({("c", 1): {"model": model, "step": 1}},
                {"model": {k: v + 1 for k, v in model.items()}, "rng": torch.arange(8.0), "step": 2})

    def build(self, world):
        _gloo()
        super().build(world)

    def run(self, world, acked):
        _before, new = self.states()
        _gloo()
        r = open_repo(os.path.join(world, "repo"))
        try:
            r.save(self.run_name, self.step, new, group=True)
            acked.append((self.run_name, self.step))
        finally:
            r.close()

    def check(self, world, acked, complete):
        before, new = self.states()
        r = open_repo(os.path.join(world, "repo"))
        try:
            for (run, step), state in before.items():
                assert_exact(r.load(run, step=step), state)
            present = self.step in steps_of(r, self.run_name)
            if complete or acked:
                assert present
            if present:
                assert_exact(r.load(self.run_name, self.step), new)  # one rank: nothing is per-rank
            r.verify()
        finally:
            r.close()


def _history(root, n=5):
    r = open_repo(root)
    for step in range(n):
        r.save("h", step, _hist_state(step))
    return r


def _hist_state(step):
    return {"w": table(step, 256), "shared": np.arange(3000.0)}


@operation("gc_repack")
class GcRepack:
    def build(self, world):
        r = _history(os.path.join(world, "repo"))
        for step in (0, 1, 2):
            r.delete("h", step)
        r.close()

    def run(self, world, acked):
        r = open_repo(os.path.join(world, "repo"))
        try:
            report = r.gc(grace=0, repack_below=0.99)
            acked.append(report)
        finally:
            r.close()

    def check(self, world, acked, complete):
        r = open_repo(os.path.join(world, "repo"))
        try:
            assert steps_of(r, "h") == {3, 4}
            for step in (3, 4):
                assert_exact(r.load("h", step=step), _hist_state(step))
            r.verify()
            if complete:
                again = r.gc(grace=0, repack_below=0, dry_run=True)  # the retry finished the work: nothing dead
                assert not again.deleted_packs and not again.condemned_packs, again
        finally:
            r.close()


@operation("prune_rm")
class PruneRm:
    def build(self, world):
        _history(os.path.join(world, "repo")).close()

    def run(self, world, acked):
        r = open_repo(os.path.join(world, "repo"))
        try:
            if 0 in steps_of(r, "h"):  # a retry after the rm went through: `luopan rm h@0` again says it is gone
                r.delete("h", 0)
            acked.append("rm")
            r.prune("h", luopan.retention.KeepLast(1))
            acked.append("prune")
        finally:
            r.close()

    def check(self, world, acked, complete):
        r = open_repo(os.path.join(world, "repo"))
        try:
            steps = steps_of(r, "h")
            assert 4 in steps
            if "rm" in acked:
                assert 0 not in steps
            if complete:
                assert steps == {4}
            for step in steps:
                assert_exact(r.load("h", step=step), _hist_state(step))
            r.verify()
        finally:
            r.close()


def _files(version):
    rng = np.random.default_rng(version)
    files = {"data/a.bin": rng.bytes(90_000), "data/b.txt": b"hello %d\n" % version, "empty": b"",
             "nested/deeper/c.bin": rng.bytes(40_000)}
    if version == 2:
        files["data/a.bin"] = files["data/a.bin"][:50_000] + b"changed" + files["data/a.bin"][50_000:]
        files["new.bin"] = rng.bytes(30_000)
    return files


def _artifact_content(art, version):
    v = art.get(version)
    out = {}
    for e in art.listing(v.version):
        if e["type"] == "file":
            with art.open(e["path"], v.version) as f:
                out[e["path"]] = f.read()
    return out


@operation("artifact_commit")
class ArtifactCommit:
    def build(self, world):
        with open_repo(os.path.join(world, "repo")) as r:
            r.artifact("ds").commit(_files(1))

    def run(self, world, acked):
        with open_repo(os.path.join(world, "repo")) as r:
            acked.append(r.artifact("ds").commit(_files(2), metadata={"v": 2}).version)

    def check(self, world, acked, complete):
        with open_repo(os.path.join(world, "repo")) as r:
            art = r.artifact("ds")
            numbers = art.numbers()
            assert numbers[0] == 1 and _artifact_content(art, 1) == _files(1)
            for n in numbers[1:]:
                assert _artifact_content(art, n) == _files(2)
            if complete or acked:
                assert len(numbers) >= 2
            else:
                assert numbers == [1], f"a failed commit left version(s) {numbers[1:]}"
            assert set(acked) <= set(numbers)
            r.verify()


def _tree(root):
    """{relative path: bytes} of a folder's files, but luopan's own (its checkout record, temporary files)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if not name.startswith(".luopan-"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[rel] = f.read()
    return out


@operation("artifact_checkout_in_place", root="co")
class ArtifactCheckoutInPlace:
    """``checkout`` of version 2 over a folder holding version 1: files changed, one removed, one added, one kept."""

    v1 = {**_files(1), "gone/old.txt": b"old\n"}
    v2 = {**_files(2), "fresh/deeper/x.bin": b"x" * 5000}  # new directories: mkdir faults too

    def build(self, world):
        with open_repo(os.path.join(world, "repo")) as r:
            r.artifact("ds").commit(self.v1)
            r.artifact("ds").commit(self.v2)
            r.artifact("ds").checkout(os.path.join(world, "co"), 1)

    def run(self, world, acked):
        with open_repo(os.path.join(world, "repo")) as r:
            r.artifact("ds").checkout(os.path.join(world, "co"), 2)
            acked.append(2)

    def check(self, world, acked, complete):
        co = os.path.join(world, "co")
        got = _tree(co)
        for path in set(self.v1) | set(self.v2):  # every file the old version's or the new one's
            assert got.get(path) in (self.v1.get(path), self.v2.get(path)), f"{path} is neither old nor new"
        with open_repo(os.path.join(world, "repo")) as r:
            art = r.artifact("ds")
            assert _artifact_content(art, 1) == self.v1 and _artifact_content(art, 2) == self.v2
            if complete or acked:
                assert got == self.v2 and art.status(co).clean


# -- journals ----------------------------------------------------------------------------------------------------
def _record(i):
    return {"i": i, "text": "r" * 900}


def _journal(world, **kw):
    from luopan.journal import Journal
    return Journal(os.path.join(world, "repo"), name="j", fsync="always", segment_bytes=4096, **kw)


@operation("journal_append")
class JournalAppend:
    BASE, NEW = 5, 8

    def build(self, world):
        with _journal(world) as j:
            j.append_many([_record(i) for i in range(self.BASE)])

    def run(self, world, acked):
        with _journal(world) as j:
            for i in range(self.BASE + len(acked), self.BASE + self.NEW):
                if i % 3 == 0:
                    j.append_many([_record(i)])
                else:
                    j.append(_record(i))
                acked.append(i)

    def check(self, world, acked, complete):
        with _journal(world, read_only=True) as j:
            got = list(j.read())
        assert got == [_record(i) for i in range(self.BASE + len(acked))], (len(got), len(acked))
        if complete:
            assert len(acked) == self.NEW


@operation("journal_compact")
class JournalCompact:
    N = 12

    def build(self, world):
        with _journal(world) as j:
            for i in range(self.N):
                j.append(_record(i))
        assert len([n for n in os.listdir(os.path.join(world, "repo", "journals", "j", "log"))
                    if n.endswith(".seg")]) >= 3

    def run(self, world, acked):
        with _journal(world) as j:
            acked.append(j.compact({"upto": j.next_seq}))

    def check(self, world, acked, complete):
        with _journal(world, read_only=True) as j:
            snap = j.latest_snapshot()
            start = 0 if snap is None else snap.seq
            if snap is not None:
                assert snap.seq == self.N and snap.value == {"upto": self.N}
            assert j.first_seq <= start
            assert list(j.read(start)) == [_record(i) for i in range(start, self.N)]
            if complete or acked:
                assert snap is not None
            if complete:
                assert j.first_seq >= j.next_seq - 4, "the covered segments were not dropped"


# -- LangGraph -----------------------------------------------------------------------------------------------------
def _saver(world, **kw):
    from luopan.langgraph import LuopanSaver
    return LuopanSaver(os.path.join(world, "repo"), fsync="always", segment_bytes=1 << 12, **kw)


def _lg_put(saver, thread, step, parent, messages):
    from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint
    ck = empty_checkpoint()
    ck["channel_versions"] = {"messages": step + 1}
    ck["channel_values"] = {"messages": messages}
    ck = create_checkpoint(ck, None, step)
    cfg = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    if parent:
        cfg["configurable"]["checkpoint_id"] = parent
    stored = saver.put(cfg, ck, {"source": "loop", "step": step}, {"messages": step + 1})
    return stored["configurable"]["checkpoint_id"], ck


def _messages(thread, step):
    return [f"{thread}-{step}: " + "words " * 200, f"{thread}-{step}-b: " + "more " * 100]


def _lg_get(saver, thread, cid):
    t = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": "", "checkpoint_id": cid}})
    return None if t is None else t.checkpoint


def _lg_chain(saver, thread, steps, done=()):
    out, parent = list(done), (done[-1][0] if done else None)
    for step in range(len(done), steps):
        cid, ck = _lg_put(saver, thread, step, parent, _messages(thread, step))
        out.append((cid, ck))
        parent = cid
    return out


LG = {}  # the checkpoints the templates hold: thread -> [(id, checkpoint)]


@operation("langgraph_put", requires="langgraph.checkpoint.base")
class LangGraphPut:
    def build(self, world):
        with _saver(world) as saver:
            LG["put-base"] = _lg_chain(saver, "t", 3)

    def run(self, world, acked):
        with _saver(world) as saver:
            chain = list(LG["put-base"]) + list(acked)
            parent = chain[-1][0]
            for step in range(len(chain), 6):
                cid, ck = _lg_put(saver, "t", step, parent, _messages("t", step))
                acked.append((cid, ck))
                parent = cid

    def check(self, world, acked, complete):
        with _saver(world) as saver:
            for cid, ck in LG["put-base"] + acked:
                assert _lg_get(saver, "t", cid) == ck
            latest = saver.get_tuple({"configurable": {"thread_id": "t", "checkpoint_ns": ""}})
            assert latest.checkpoint == (LG["put-base"] + acked)[-1][1]
            if complete:
                assert len(acked) == 3


@operation("langgraph_prune", requires="langgraph.checkpoint.base")
class LangGraphPrune:
    def build(self, world):
        with _saver(world) as saver:
            LG["t"] = _lg_chain(saver, "t", 6)
            LG["u"] = _lg_chain(saver, "u", 2)

    def run(self, world, acked):
        with _saver(world, compact_min_dead_bytes=1024) as saver:
            saver.prune(["t"], keep_last=1)  # most of the journal is dead then: the saver compacts it
            acked.append("pruned")

    def check(self, world, acked, complete):
        with _saver(world) as saver:
            for cid, ck in LG["t"][-1:] + LG["u"]:
                assert _lg_get(saver, "t" if (cid, ck) in LG["t"] else "u", cid) == ck
            for cid, ck in LG["t"][:-1]:
                got = _lg_get(saver, "t", cid)
                if complete or acked:
                    assert got is None
                else:
                    assert got in (None, ck)


# -- vector indexes ------------------------------------------------------------------------------------------------
def _flat(n):
    import faiss
    index = faiss.IndexFlatL2(16)
    index.add(np.random.default_rng(11).standard_normal((n, 16)).astype("float32"))
    return index


def _vectors(index):
    return index.reconstruct_n(0, index.ntotal)


INDEX_SIZES = {1: 300, 2: 600, 3: 900}


@operation("index_snapshot", requires="faiss")
class IndexSnapshot:
    def build(self, world):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            for v in (1, 2):
                idx.snapshot(_flat(INDEX_SIZES[v]))

    def run(self, world, acked):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            acked.append(idx.snapshot(_flat(INDEX_SIZES[3])))

    def check(self, world, acked, complete):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            versions = idx.versions()
            assert versions[:2] == [1, 2]
            for v in versions:
                assert np.array_equal(_vectors(idx.load(v)), _vectors(_flat(INDEX_SIZES[min(v, 3)])))
            live = idx.current()
            assert live in versions
            if complete or acked:
                assert live == versions[-1] and len(versions) >= 3
            assert np.array_equal(_vectors(idx.load()), _vectors(idx.load(live)))
            r.verify()


def _churned(v):
    """An IDMap2 flat index after ``v - 1`` rounds of remove_ids + add (versions after the first are row maps)."""
    import faiss
    rng = np.random.default_rng(12)
    index = faiss.IndexIDMap2(faiss.IndexFlatL2(16))
    index.add_with_ids(rng.standard_normal((400, 16)).astype("float32"), np.arange(400))
    for k in range(1, v):
        index.remove_ids(np.arange(k, 400, 23 + k))
        index.add_with_ids(rng.standard_normal((4, 16)).astype("float32"), np.arange(4) + 1000 * k)
    return index


@operation("index_snapshot_after_remove", requires="faiss")
class IndexSnapshotAfterRemove:
    def build(self, world):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            for v in (1, 2):
                idx.snapshot(_churned(v))

    def run(self, world, acked):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            acked.append(idx.snapshot(_churned(3)))

    def check(self, world, acked, complete):
        import faiss
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            versions = idx.versions()
            assert versions[:2] == [1, 2]
            for v in versions:
                want = faiss.serialize_index(_churned(min(v, 3)))
                assert np.array_equal(faiss.serialize_index(idx.load(v)), want), v
            live = idx.current()
            if complete or acked:
                assert live == versions[-1] and len(versions) >= 3 and idx.manifest(live).get("rowmaps")
            r.verify()


@operation("index_rollback", requires="faiss")
class IndexRollback:
    def build(self, world):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            for v in (1, 2, 3):
                idx.snapshot(_flat(INDEX_SIZES[v]))

    def run(self, world, acked):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            idx.rollback(1)
            acked.append(1)

    def check(self, world, acked, complete):
        with open_repo(os.path.join(world, "repo")) as r, luopan.index.IndexStore(r, "kb") as idx:
            assert idx.versions() == [1, 2, 3]
            for v in (1, 2, 3):
                assert np.array_equal(_vectors(idx.load(v)), _vectors(_flat(INDEX_SIZES[v])))
            live = idx.current()
            assert live == 1 if (complete or acked) else live in (1, 3)
            assert np.array_equal(_vectors(idx.load()), _vectors(_flat(INDEX_SIZES[live])))


# -- channels and patches --------------------------------------------------------------------------------------------
CHANNEL: dict[str, Any] = {}


def _channel_setup(tmp_root):
    """Keys, a repository with steps 1 and 2 of run-a, their exports, a channel with both published (for pulls) and
    a patch file from 1 to 2 (for patch apply): built once, outside every world."""
    if CHANNEL:
        return CHANNEL
    from luopan.channel import publish
    from luopan.signing import generate_key, load_signing_key
    base = os.path.join(tmp_root, "channel-setup")
    os.makedirs(base)
    generate_key(os.path.join(base, "keys"), "release")
    os.makedirs(os.path.join(base, "trusted"))
    shutil.copy(os.path.join(base, "keys", "release.pub"), os.path.join(base, "trusted"))
    key = load_signing_key(os.path.join(base, "keys", "release.key"))
    repo = open_repo(os.path.join(base, "repo"))
    rng = np.random.default_rng(0)
    state = {"model": {f"w{i}": rng.standard_normal((64, 256), dtype=np.float32) for i in range(4)}}
    exports = {}
    for step in (1, 2):
        if step > 1:
            state["model"]["w1"][:8] += 1.0
        repo.save("run-a", step, state)
        publish(repo, "run-a", step, os.path.join(base, "site", "stable"), sign_key=key, subtree="model")
        shutil.copytree(os.path.join(base, "site", "stable"), os.path.join(base, f"snap-v{step}"),
                        ignore=shutil.ignore_patterns(".*"))
        exports[step] = os.path.join(base, f"v{step}.safetensors")
        repo.export("run-a", exports[step], step, subtree="model")
    luopan.patch.create(repo, "run-a", 1, 2, os.path.join(base, "1-2.lpatch"), subtree="model")
    repo.close()
    CHANNEL.update(base=base, key=key, trusted=os.path.join(base, "trusted"), chan=os.path.join(base, "site", "stable"),
                   exports={s: open(p, "rb").read() for s, p in exports.items()},
                   export_paths=exports, repo=os.path.join(base, "repo"), patch=os.path.join(base, "1-2.lpatch"))
    return CHANNEL


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# publish makes its scratch directory beside the channel, or in <channel>/.tmp when it cannot (files.make_scratch)
@operation("publish", root="site/stable", silent=r"^site/\.stable\.publish-tmp/publish-[0-9a-f]+$")
class Publish:
    def build(self, world):
        from luopan.channel import publish
        c = CHANNEL
        shutil.copytree(c["repo"], os.path.join(world, "repo"))
        os.makedirs(os.path.join(world, "site"))
        publish(os.path.join(world, "repo"), "run-a", 1, os.path.join(world, "site", "stable"), sign_key=c["key"],
                subtree="model")

    def run(self, world, acked):
        from luopan.channel import publish
        acked.append(publish(os.path.join(world, "repo"), "run-a", 2, os.path.join(world, "site", "stable"),
                             sign_key=CHANNEL["key"], subtree="model")["version"])

    def check(self, world, acked, complete):
        from luopan.channel import parse_index, pull
        chan = os.path.join(world, "site", "stable")
        index = parse_index(_read(os.path.join(chan, "index.json")))
        # a retry after a publish whose index was written (but maybe not durable) renews it: index version 3
        assert [v.step for v in index.versions] in ([1], [1, 2]), index.versions
        if complete or acked:
            assert index.version >= 2 and index.latest.step == 2
        out = os.path.join(world, "..", f"check-{os.path.basename(world)}.safetensors")
        try:  # a device pulls the newest version whole, and from version 1 through the patch
            pull(chan, None, out, trusted_keys=CHANNEL["trusted"])
            assert _read(out) == CHANNEL["exports"][index.latest.step]
            if index.latest.step == 2:
                os.unlink(out)
                got = pull(chan, CHANNEL["export_paths"][1], out, trusted_keys=CHANNEL["trusted"])
                assert got["kind"] == "patch" and _read(out) == CHANNEL["exports"][2]
        finally:
            if os.path.exists(out):
                os.unlink(out)


@operation("pull", root="device")
class Pull:
    def build(self, world):
        from luopan.channel import pull, read_state
        c = CHANNEL
        dev = os.path.join(world, "device")
        os.makedirs(dev)
        shutil.copy(c["export_paths"][1], os.path.join(dev, "model.safetensors"))
        # the device records what it has: a pull from the channel as it was with only version 1
        got = pull(os.path.join(c["base"], "snap-v1"), os.path.join(dev, "model.safetensors"),
                   os.path.join(dev, "model.safetensors"), trusted_keys=c["trusted"],
                   state_file=os.path.join(dev, "state"))
        assert got["up_to_date"] and read_state(os.path.join(dev, "state")).version == 1

    def run(self, world, acked):
        from luopan.channel import pull
        dev = os.path.join(world, "device")
        got = pull(CHANNEL["chan"], os.path.join(dev, "model.safetensors"), os.path.join(dev, "new.safetensors"),
                   trusted_keys=CHANNEL["trusted"], state_file=os.path.join(dev, "state"))
        assert got["up_to_date"] or got["kind"] == "patch", got
        acked.append(got)

    def check(self, world, acked, complete):
        from luopan.channel import read_state
        dev = os.path.join(world, "device")
        assert _read(os.path.join(dev, "model.safetensors")) == CHANNEL["exports"][1]
        out = os.path.join(dev, "new.safetensors")
        if complete or acked:
            assert os.path.exists(out)
        if os.path.exists(out):
            assert _read(out) == CHANNEL["exports"][2]
        st = read_state(os.path.join(dev, "state"))  # it reads, and records version 1 or 2
        assert st.version == 2 if complete else st.version in (1, 2), st


@operation("patch_apply", root="out")
class PatchApply:
    def build(self, world):
        os.makedirs(os.path.join(world, "out"))

    def run(self, world, acked):
        got = luopan.patch.apply(CHANNEL["patch"], CHANNEL["export_paths"][1],
                                 os.path.join(world, "out", "model.safetensors"))
        acked.append(got)

    def check(self, world, acked, complete):
        out = os.path.join(world, "out", "model.safetensors")
        if complete or acked:
            assert os.path.exists(out)
        if os.path.exists(out):
            assert _read(out) == CHANNEL["exports"][2]
        assert [n for n in os.listdir(os.path.join(world, "out")) if n != "model.safetensors"] == []


# -- upgrade -------------------------------------------------------------------------------------------------------
@operation("upgrade")
class Upgrade:
    def build(self, world):
        shutil.copytree(os.path.join(DATA, "v6_repo", "auto"), os.path.join(world, "repo"))

    def run(self, world, acked):
        from luopan.cli import maintain
        maintain.upgrade.__wrapped__(repo=os.path.join(world, "repo"), dry_run=False, as_json=False)
        acked.append(8)

    def check(self, world, acked, complete):
        root = os.path.join(world, "repo")
        version = config_version(root)
        assert version == 8 if (complete or acked) else version in (6, 8)
        gen = data_module("make_v6_repo")
        with luopan.open(root, progress=False) as r:
            assert_lora_loads(r, gen, gen.STEPS)


# -- the harness -----------------------------------------------------------------------------------------------------
def schedule(count, offset):
    """(n, errno, sticky) for a call kind made ``count`` times. By default every n once, the errno cycling with n
    (shifted by ``offset``, so each call kind meets each errno), every errno at least once. With FAULTS_ALL: every n
    with every errno, and every n again failing it and every later call of the kind (a disk that stays full)."""
    if count == 0:
        return []
    ns = range(1, count + 1)
    if FAULTS_ALL:
        return ([(n, code, False) for n in ns for code in ERRNOS]
                + [(n, ERRNOS[(n + offset) % len(ERRNOS)], True) for n in ns])
    cases = [(n, ERRNOS[(n + offset) % len(ERRNOS)], False) for n in ns]
    for i, code in enumerate(ERRNOS):
        if code not in {c for _n, c, _s in cases}:
            cases.append((ns[i % count], code, False))
    return cases


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """name -> (template world, call counts): each operation's starting state, built once, and what it does."""
    root = tmp_path_factory.mktemp("fault-templates")
    built: dict[str, tuple[str, dict[str, int]]] = {}

    def get(name):
        if name not in built:
            op = OPERATIONS[name]
            if name in ("publish", "pull", "patch_apply"):
                _channel_setup(str(tmp_path_factory.mktemp("channel")))
            world = str(root / name)
            os.makedirs(world)
            op.build(world)
            probe = str(root / f"{name}-count")
            shutil.copytree(world, probe, symlinks=True)
            acked: list = []
            counts = Faults.count(probe, lambda: op.run(probe, acked))
            op.check(probe, acked, True)
            built[name] = (world, counts)
        return built[name]

    yield get
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def strip_tmp(path):
    return re.sub(r"\.tmp-[^/]*$", "", path)


def names_the_place(msg, failed, world, op):
    """The message names the file that failed (its final name, or its directory) or the operation's location."""
    candidates = {os.path.join(world, op.root)}
    if failed:
        for p in (failed, strip_tmp(failed)):
            candidates |= {p, os.path.dirname(p)}
    return any(c in msg for c in candidates)


def run_case(op, template, call, n, code, tmp_path, sticky=False):
    world = str(tmp_path / f"{call}-{n}-{errno.errorcode[code]}{'-on' if sticky else ''}")
    shutil.copytree(template, world, symlinks=True)
    world = os.path.realpath(world)
    acked: list = []
    where = f"{op.name}: {call} #{n}{' and every later one' if sticky else ''} failing with {errno.errorcode[code]}"
    with Faults(world, call, n, code, sticky=sticky) as f, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            op.run(world, acked)
        except Exception as exc:  # noqa: BLE001 - what it is, is what is checked
            error = exc
        else:
            error = None
    if f.fired:
        trace = "".join(traceback.format_exception(error)) if error is not None else ""
        rel = os.path.relpath(f.failed, world)
        where += f" (at {rel})"
        if error is None:
            # Only after the commit: tidying up (a lock record, a temporary name) or an advisory file (the latest ref,
            # a log's sync mark) may fail without failing the operation — with a warning naming it, or silently where
            # nothing is lost at all (SILENT). The result must then be wholly there.
            said = [str(w.message) for w in warned if names_the_place(str(w.message), f.failed, world, op)]
            quiet = re.search(SILENT, rel) or (op.silent and re.search(op.silent, rel))
            assert said or quiet, f"{where}: the operation reported success, with no warning"
            try:
                op.check(world, acked, True)
            except Exception as exc:  # noqa: BLE001
                raise AssertionError(f"{where}: reported success, but its result is not all there: {exc!r}") from exc
        assert isinstance(error, (luopan.LuopanError, type(None))), f"{where}: not a luopan error:\n{trace}"
    if f.fired and error is not None:
        cls = luopan.StorageFullError if code in FULL else luopan.StorageError
        assert isinstance(error, cls), f"{where}: {type(error).__name__}, not {cls.__name__}: {error}\n{trace}"
        if code not in FULL:
            assert not isinstance(error, luopan.StorageFullError), f"{where}: an I/O error reported as a full disk"
        assert error.errno == code, f"{where}: errno {error.errno}: {error}"
        msg = str(error)
        assert names_the_place(msg, f.failed, world, op), f"{where}: the message names no path: {msg}"
        assert REMEDY.search(msg) and RETRY.search(msg), f"{where}: the message does not say what to do: {msg}"
    else:
        assert error is None, f"{where}: failed without a fault: {error!r}"
    try:
        op.check(world, acked, False)  # committed data intact, the repository opens
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{where}: after the failure ({error}): {exc!r}") from exc
    if error is None:
        shutil.rmtree(world, ignore_errors=True)
        return bool(f.fired)
    try:
        op.run(world, acked)  # the fault has cleared: the same operation again
        op.check(world, acked, True)
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{where}: the retry after the failure ({error}) failed: {exc!r}") from exc
    shutil.rmtree(world, ignore_errors=True)
    return bool(f.fired)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("name", list(OPERATIONS))
def test_every_fault_is_one_clear_error_and_loses_nothing(templates, tmp_path, name, call):
    op = OPERATIONS[name]
    if op.requires:
        pytest.importorskip(op.requires)
    template, counts = templates(name)
    cases = schedule(counts[call], CALLS.index(call))
    if not cases:
        pytest.skip(f"{name} makes no {call} call")
    fired, failures = 0, []
    for n, code, sticky in cases:  # every case runs; the failures are reported together
        try:
            fired += run_case(op, template, call, n, code, tmp_path, sticky)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n\n".join(failures)
    assert fired, f"{name}: none of the {len(cases)} {call} faults happened ({counts})"


# -- the injector itself -------------------------------------------------------------------------------------------
def test_faults_fail_the_nth_call_of_each_kind_under_the_world_only(tmp_path):
    world, outside = tmp_path / "w", tmp_path / "outside"
    world.mkdir()
    outside.mkdir()

    def writes():
        for d in (world, outside):
            fd = os.open(d / "a", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, b"x" * 100)
                os.write(fd, b"y" * 100)
            finally:
                os.close(fd)

    assert Faults.count(world, writes) == {"write": 2, "fsync": 0, "rename": 0, "mkdir": 0}
    with Faults(world, "write", 2, errno.ENOSPC) as f, pytest.raises(OSError) as err:
        writes()
    assert err.value.errno == errno.ENOSPC and f.fired == 1 and f.failed == os.path.realpath(world / "a")
    assert (world / "a").read_bytes() == b"x" * 100 + b"y" * 50  # a full disk takes half, then refuses
    fd = os.open(world / "b", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with Faults(world, "write", 1, errno.EIO), pytest.raises(OSError):
            os.pwrite(fd, b"z" * 10, 0)
    finally:
        os.close(fd)
    assert (world / "b").read_bytes() == b""  # EIO writes nothing
    with Faults(world, "write", 1, errno.EIO) as f:  # outside the world: never counted, never failed
        (outside / "c").write_bytes(b"c")
    assert f.counts["write"] == 0 and (outside / "c").read_bytes() == b"c"


def test_faults_reach_buffered_file_objects_and_every_call_kind(tmp_path):
    world = tmp_path / "w"
    world.mkdir()
    with Faults(world, "write", 1, errno.EDQUOT), pytest.raises(OSError) as err:
        with open(world / "f", "wb") as fh:  # buffered: the bytes reach the file at close
            fh.write(b"q" * 1000)
    assert err.value.errno == errno.EDQUOT and len((world / "f").read_bytes()) == 500
    (world / "src").write_bytes(b"s")
    fd = os.open(world / "src", os.O_RDONLY)
    try:
        with Faults(world, "fsync", 1, errno.EIO), pytest.raises(OSError, match="Input/output"):
            os.fsync(fd)
    finally:
        os.close(fd)
    with Faults(world, "rename", 2, errno.EIO) as f:
        os.replace(world / "src", world / "dst")
        with pytest.raises(OSError):
            os.link(world / "dst", world / "linked")
    assert f.counts["rename"] == 2 and not (world / "linked").exists()
    with Faults(world, "mkdir", 3, errno.ENOSPC) as f:
        os.makedirs(world / "made", exist_ok=True)  # 1
        os.makedirs(world / "made", exist_ok=True)  # EEXIST comes first: not counted, not failed
        with pytest.raises(OSError):
            os.makedirs(world / "x" / "y")  # 2 makes x, 3 fails
    assert f.counts["mkdir"] == 3 and (world / "x").is_dir() and not (world / "x" / "y").exists()
    with Faults(world, "mkdir", 1, errno.ENOSPC, sticky=True) as f:  # a disk that stays full
        for name in ("p", "q"):
            with pytest.raises(OSError):
                os.mkdir(world / name)
    assert f.fired == 2


# -- a collective save on several ranks ----------------------------------------------------------------------------
class _Gathered:
    """A stand-in for torch.distributed whose all_gather_object hands out the ranks' reports given."""

    def __init__(self, reports):
        self.reports = reports

    def get_world_size(self, group):
        return len(self.reports)

    def all_gather_object(self, out, mine, group=None):
        out[:] = self.reports


def test_a_store_failure_on_one_rank_is_the_same_typed_error_on_every_rank():
    """Every rank raises the same error; a rank's full disk is a StorageFullError on all of them (so all can free
    space and save again together), an I/O error a StorageError; any other failure a plain CollectiveError."""
    from luopan.checkpoint.distributed import collective as C
    full = luopan.StorageFullError(errno.ENOSPC, "no space left on '/r' while writing packs/ab/x.pack: free space")
    broken = luopan.StorageError(errno.EIO, "cannot write index/x.json in /r: Input/output error; check the disk")
    ok = (True, None)
    with pytest.raises(luopan.CollectiveStorageFullError, match="rank 1: StorageFullError.*packs/ab/x.pack") as e:
        C._agree(_Gathered([ok, (False, C._failure(full))]), None, True, None)
    assert isinstance(e.value, luopan.CollectiveError) and e.value.errno == errno.ENOSPC
    with pytest.raises(luopan.CollectiveStorageError) as e:
        C._agree(_Gathered([(False, C._failure(broken)), (False, C._failure(full))]), None, True, None)
    assert not isinstance(e.value, luopan.StorageFullError) and e.value.errno == errno.EIO
    with pytest.raises(luopan.CollectiveError) as e:
        C._agree(_Gathered([(False, C._failure(ValueError("bad"))), (False, C._failure(full))]), None, True, None)
    assert not isinstance(e.value, luopan.StorageError) and "rank 0: ValueError: bad" in str(e.value)

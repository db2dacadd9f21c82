"""luopan.index op log: log_add / log_remove journaled against the live version and replayed by load()."""

from __future__ import annotations

import os

import numpy as np
import pytest

import luopan
from luopan.errors import ArgumentTypeError, IntegrityError, UsageError
from luopan.index import oplog

faiss = pytest.importorskip("faiss")

D = 16
RNG = np.random.default_rng(3)
X = RNG.standard_normal((3000, D)).astype("float32")
Q = RNG.standard_normal((40, D)).astype("float32")


def same_search(a, b):
    da, ia = a.search(Q, 8)
    db, ib = b.search(Q, 8)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(da, db)


def idmap_ivf():
    sub = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 16)
    sub.train(X)
    sub.nprobe = 4
    index = faiss.IndexIDMap2(sub)
    index.add_with_ids(X, np.arange(len(X)) + 1000)
    return index


def test_replay_equals_applying_the_ops(repo):
    index = idmap_ivf()
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    new = RNG.standard_normal((50, D)).astype("float32")
    ids = np.arange(50) + 90_000
    assert idx.log_add(ids, new) == 0
    assert idx.log_remove(np.array([1000, 1001, 90_003])) == 1
    index.add_with_ids(new, ids)
    index.remove_ids(np.array([1000, 1001, 90_003], dtype=np.int64))
    same_search(index, idx.load())
    idx.close()
    with luopan.open(repo.store.root, create=False) as fresh:  # replayed from disk by another Repo
        same_search(index, luopan.index.IndexStore(fresh, "kb").load())
    before = luopan.index.IndexStore(repo, "kb").load(1)  # an explicit version: the snapshot as saved
    assert before.ntotal == len(X)


def test_flat_replays_add_without_ids_and_snapshot_starts_a_clean_log(repo):
    index = faiss.IndexFlatL2(D)
    index.add(X)
    idx = luopan.index.IndexStore(repo, "flat")
    idx.snapshot(index)
    more = RNG.standard_normal((20, D)).astype("float32")
    idx.log_add(np.arange(20), more)
    index.add(more)
    same_search(index, idx.load())
    assert idx.snapshot(idx.load()) == 2  # the snapshot holds the replayed ops: version 2 has no records
    loaded = idx.load()
    assert loaded.ntotal == len(X) + 20
    same_search(index, loaded)


def test_rollback_does_not_replay_records_of_other_versions(repo):
    index = idmap_ivf()
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    v1 = faiss.clone_index(index)
    idx.log_add([1], RNG.standard_normal((1, D)))
    index.add_with_ids(RNG.standard_normal((30, D)).astype("float32"), np.arange(30) + 50_000)
    idx.snapshot(index)
    idx.log_add([2], RNG.standard_normal((1, D)))  # against version 2
    assert idx.load().ntotal == index.ntotal + 1
    idx.rollback(1)
    same_search(v1, idx.load())  # neither v1's records from before the rollback nor v2's are replayed
    extra = RNG.standard_normal((3, D)).astype("float32")
    idx.log_add([7, 8, 9], extra)  # logged against 1 after the rollback: replayed
    v1.add_with_ids(extra, np.array([7, 8, 9]))
    same_search(v1, idx.load())


def test_torn_and_garbage_log_tail_is_cut_by_the_log(repo, repo_path):
    index = idmap_ivf()
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    vecs = RNG.standard_normal((5, D)).astype("float32")
    idx.log_add(np.arange(5) + 70_000, vecs)
    idx.close()
    log_dir = repo_path / "indexes" / "kb" / "log"
    seg = max(p for p in os.listdir(log_dir) if p.endswith(".seg"))
    with open(log_dir / seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage-torn-record")
    index.add_with_ids(vecs, np.arange(5) + 70_000)
    idx2 = luopan.index.IndexStore(luopan.open(repo_path, create=False), "kb")
    same_search(index, idx2.load())
    assert idx2.log_add([1], RNG.standard_normal((1, D))) == 1  # appending cuts the torn tail and goes on


def test_log_refusals_and_record_checks(repo):
    idx = luopan.index.IndexStore(repo, "kb")
    with pytest.raises(UsageError, match="no snapshot"):
        idx.log_add([1], np.zeros((1, D)))
    h = faiss.IndexHNSWFlat(D, 8)
    h.add(X[:100])
    idx.snapshot(h)
    with pytest.raises(UsageError, match="remove"):
        idx.log_remove([1])
    with pytest.raises(ArgumentTypeError, match="shape"):
        idx.log_add([1], np.zeros((1, D + 1)))
    with pytest.raises(ArgumentTypeError):
        idx.log_add(["a"], np.zeros((1, D)))
    with pytest.raises(UsageError, match="one id per vector"):
        idx.log_add([1, 2], np.zeros((1, D)))
    payload = oplog.encode("add", 3, np.array([5], dtype=np.int64), np.ones((1, D), dtype=np.float32))
    op = oplog.decode(payload, "x")
    assert op.op == "add" and op.base == 3 and op.ids.tolist() == [5] and op.vectors.shape == (1, D)
    for broken in (payload[:-1], b"nope" + payload[4:], payload[:12] + b"[" + payload[13:]):
        with pytest.raises(IntegrityError):
            oplog.decode(broken, "x")


def test_a_lost_op_log_continues_at_the_live_start(tmp_path):
    """The op log directory lost after ops were logged: new records must not get seqs below the live version's
    start (load() would skip them); the log continues at that start."""
    import shutil

    import faiss
    import numpy as np

    import luopan
    from luopan.errors import CorruptJournalError

    repo = luopan.open(tmp_path / "r")
    idx = luopan.index.IndexStore(repo, "kb")
    x = np.random.default_rng(0).standard_normal((50, 8), dtype=np.float32)
    index = faiss.IndexFlatL2(8)
    index.add(x[:10])
    idx.snapshot(index)
    idx.log_add(np.arange(10, 20), x[10:20])
    idx.snapshot(index)  # live version 2 starts after record 0
    idx.close()
    shutil.rmtree(tmp_path / "r" / "indexes" / "kb" / "log")
    idx = luopan.index.IndexStore(repo, "kb")
    seq = idx.log_add(np.arange(20, 25), x[20:25])  # an empty log continues at the live version's start
    assert seq == 1 and idx.load().ntotal == 15

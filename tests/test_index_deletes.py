"""luopan.index with deletions (docs/format.md §17.7): after ``remove_ids`` a snapshot stores what changed as a row map
(the pool of stored rows and runs naming the live ones), not a full copy; every version loads as the index that was
snapshotted, bit for bit (``faiss.serialize_index``); rollback, prune and gc keep working; a crash during such a
snapshot leaves the version wholly there or absent."""

from __future__ import annotations

import os

import numpy as np
import pytest

import luopan
from luopan.errors import CorruptManifestError, IntegrityError
from luopan.format.canonical import seal, unseal
from luopan.index import tables

from .crashstates import check_crash_states
from .powerloss import Recorder

faiss = pytest.importorskip("faiss")

D = 32
N = 20_000
RNG = np.random.default_rng(31)
X = RNG.standard_normal((N, D)).astype("float32")
Q = RNG.standard_normal((40, D)).astype("float32")


def make(kind):
    if kind == "ivf_flat":
        index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 64)
    elif kind == "ivf_pq":
        index = faiss.IndexIVFPQ(faiss.IndexFlatL2(D), D, 64, 8, 8)
    else:
        index = faiss.IndexIDMap(faiss.IndexFlatL2(D))
    if kind != "idmap_flat":
        index.train(X[:5000])
        index.nprobe = 8
    index.add_with_ids(X, np.arange(N))
    return index


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


def serialized(index):
    return faiss.serialize_index(index).tobytes()


def same_search(a, b):
    da, ia = a.search(Q, 10)
    db, ib = b.search(Q, 10)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(da, db)


class Churn:
    """Removes ~1% of the live ids and adds ~1% new vectors, as a served index does between snapshots."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.alive = np.arange(N)
        self.next_id = N

    def remove(self, index, frac=0.01):
        gone = self.rng.choice(self.alive, int(N * frac), replace=False)
        assert index.remove_ids(gone) == len(gone)
        self.alive = np.setdiff1d(self.alive, gone)

    def add(self, index, frac=0.01):
        n = int(N * frac)
        ids = np.arange(self.next_id, self.next_id + n)
        index.add_with_ids(self.rng.standard_normal((n, D)).astype("float32"), ids)
        self.alive = np.concatenate([self.alive, ids])
        self.next_id += n


@pytest.mark.parametrize("kind", ["ivf_flat", "idmap_flat", "ivf_pq"])
def test_versions_with_deletions_store_about_what_changed(repo_path, kind):
    index = make(kind)
    churn = Churn()
    saved = {}
    with luopan.open(repo_path) as repo:
        idx = luopan.index.IndexStore(repo, "kb")
        saved[idx.snapshot(index)] = serialized(index)
        churn.add(index)  # a version that only grew (IVF: two segments before the first removal)
        saved[idx.snapshot(index)] = serialized(index)
        grown = []
        for step in range(6):
            churn.remove(index)
            if step != 3:  # one version removes without adding
                churn.add(index)
            before = dir_bytes(repo_path)
            v = idx.snapshot(index)
            grown.append(dir_bytes(repo_path) - before)
            saved[v] = serialized(index)
            assert idx.manifest(v).get("rowmaps"), "a version after remove_ids is stored as a row map"
            assert serialized(idx.load(v)) == saved[v]  # bitwise the index faiss has
        churn.add(index)  # appends after removals: the row map grows, nothing is read back
        saved[idx.snapshot(index)] = serialized(index)
        full = len(saved[max(saved)])
        # with the full copy each version after remove_ids cost ~97% (IVF-PQ ~66%) of faiss.serialize_index
        assert max(grown) < 0.2 * full, (grown, full)
        assert sum(grown) / len(grown) < 0.1 * full, (grown, full)
        same_search(index, idx.load())

    with luopan.open(repo_path, create=False) as fresh:  # every version, read by a new process's Repo
        idx = luopan.index.IndexStore(fresh, "kb")
        for v, data in saved.items():
            loaded = idx.load(v)
            assert serialized(loaded) == data, v
            assert idx.ids(v) is None or kind != "idmap_flat" or \
                np.array_equal(idx.ids(v), faiss.vector_to_array(faiss.deserialize_index(
                    np.frombuffer(data, np.uint8)).id_map))
        fresh.verify()
        # rollback across the deletion versions, then a new version on top of the old one
        idx.rollback(2)
        old = idx.load()
        assert serialized(old) == saved[2]
        old.remove_ids(np.arange(0, N, 50))
        v = idx.snapshot(old)
        assert serialized(idx.load(v)) == serialized(old) and idx.current() == v
        # prune and gc keep what the kept versions name
        removed = idx.prune(keep_last=3)
        assert removed and 2 not in idx.versions()
        fresh.gc(grace=0)
        for v in idx.versions():
            assert v not in saved or serialized(idx.load(v)) == saved[v]
        fresh.verify()


def test_flat_without_idmap_user_ids_and_idmap2_ivf(repo):
    flat = faiss.IndexFlatL2(D)
    flat.add(X[:4000])
    ids = np.arange(4000) * 3
    sub = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 16)
    sub.train(X[:4000])
    idmap2 = faiss.IndexIDMap2(sub)
    idmap2.add_with_ids(X[:4000], np.arange(4000) + 7)
    a, b = luopan.index.IndexStore(repo, "flat"), luopan.index.IndexStore(repo, "ivf2")
    a.snapshot(flat, ids=ids)
    b.snapshot(idmap2)
    gone = np.arange(10, 4000, 97)  # flat: positions; its user ids compact alike
    flat.remove_ids(gone)
    ids = np.delete(ids, gone)
    idmap2.remove_ids(np.arange(7, 4007, 89))
    va, vb = a.snapshot(flat, ids=ids), b.snapshot(idmap2)
    assert a.manifest(va)["rowmaps"] and b.manifest(vb)["rowmaps"]
    assert serialized(a.load()) == serialized(flat) and serialized(b.load()) == serialized(idmap2)
    np.testing.assert_array_equal(a.ids(), ids)
    np.testing.assert_array_equal(b.ids(), faiss.vector_to_array(idmap2.id_map))
    assert a.info()["stats"]["new_bytes"] < 0.2 * flat.ntotal * D * 4


def test_appends_after_a_removal_extend_the_row_map_without_reading(repo, monkeypatch):
    index = make("ivf_flat")
    churn = Churn(1)
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    churn.remove(index)
    idx.snapshot(index)

    def no_general(*a, **k):
        raise AssertionError("the previous pool was read and matched")

    monkeypatch.setattr(tables, "_general", no_general)
    churn.add(index)
    v = idx.snapshot(index)
    assert idx.manifest(v)["rowmaps"] and serialized(idx.load(v)) == serialized(index)
    assert idx.info(v)["stats"]["new_bytes"] < 0.05 * len(serialized(index))


def test_a_mostly_dead_pool_is_cut_fresh(repo):
    index = make("idmap_flat")
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    index.remove_ids(np.arange(0, N, 2))
    v2 = idx.snapshot(index)
    assert idx.manifest(v2)["rowmaps"]
    index.remove_ids(np.arange(1, N, 4))  # three quarters of the pool dead
    v3 = idx.snapshot(index)
    assert "rowmaps" not in idx.manifest(v3) and idx.manifest(v3)["format_version"] == 4
    assert serialized(idx.load(v3)) == serialized(index)
    assert serialized(idx.load(v2)) != serialized(index)


def test_damaged_row_maps_are_typed_errors(repo, repo_path):
    index = make("ivf_flat")
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(index)
    index.remove_ids(np.arange(0, N, 100))
    idx.snapshot(index)
    key = repo_path / "indexes" / "kb" / "_v" / "00000002.json"
    raw = key.read_bytes()
    good = unseal(raw if raw[:1] == b"{" else __import__("zstandard").decompress(raw))
    rm = good["rowmaps"][0]
    cases = [({**good, "rowmaps": [{**rm, "xxh3": "0" * 32}]}, IntegrityError, "do not hash"),
             ({**good, "rowmaps": [{**rm, "rows": rm["rows"] - 1}]}, CorruptManifestError, "add up|counts"),
             ({**good, "format_version": 4}, CorruptManifestError, "rowmaps member"),
             ({**good, "rowmaps": [{**rm, "runs": rm["columns"][0]}]}, CorruptManifestError, "another role")]
    for doc, err, match in cases:
        key.write_bytes(seal(doc))
        with pytest.raises(err, match=match):
            idx.load(2)
    key.write_bytes(seal(good))
    assert serialized(idx.load(2)) == serialized(index)


def test_an_older_config_keeps_full_copies_until_upgraded(tmp_path):
    root = tmp_path / "r"
    index = make("idmap_flat")
    with luopan.open(root, compression="zstd") as repo:  # format 1: written as an older luopan reads it
        idx = luopan.index.IndexStore(repo, "kb")
        idx.snapshot(index)
        index.remove_ids(np.arange(0, N, 100))
        v = idx.snapshot(index)
        assert "rowmaps" not in idx.manifest(v) and serialized(idx.load(v)) == serialized(index)
        repo.repository.require_format(luopan.format.FORMAT_VERSION)  # what `luopan upgrade` does
        index.remove_ids(np.arange(1, N, 100))
        v = idx.snapshot(index)
        assert idx.manifest(v)["rowmaps"] and serialized(idx.load(v)) == serialized(index)


def test_power_loss_during_a_snapshot_after_remove_ids(tmp_path):
    """The row-map write path (previous pool read back, its tail and runs written, manifest, ref): in every crash
    state the repository opens, versions 1 and 2 load bit for bit, version 3 is wholly there (bit for bit) or absent,
    and once acknowledged it is there and live."""
    world = tmp_path / "w"
    root = world / "repo"
    small = faiss.IndexIDMap2(faiss.IndexFlatL2(8))
    rng = np.random.default_rng(3)
    small.add_with_ids(rng.standard_normal((600, 8)).astype("float32"), np.arange(600))
    want = {}
    with luopan.open(root, progress=False) as r, luopan.index.IndexStore(r, "kb") as idx:
        want[idx.snapshot(small)] = serialized(small)
        small.remove_ids(np.arange(0, 600, 40))
        want[idx.snapshot(small)] = serialized(small)
    small.remove_ids(np.arange(1, 600, 30))
    small.add_with_ids(rng.standard_normal((5, 8)).astype("float32"), np.arange(5) + 1000)
    want[3] = serialized(small)

    with Recorder(world) as rec:
        with luopan.open(root, progress=False) as r, luopan.index.IndexStore(r, "kb") as idx:
            assert idx.snapshot(small) == 3
            rec.ack("snapshot")

    def check(state):
        with luopan.open(os.path.join(state.root, "repo"), create=False, progress=False) as r, \
                luopan.index.IndexStore(r, "kb") as idx:
            versions = idx.versions()
            assert versions in ([1, 2], [1, 2, 3]), versions
            for v in versions:
                assert serialized(idx.load(v)) == want[v], v
            if "snapshot" in state.acks:
                assert versions == [1, 2, 3] and idx.current() == 3
            assert serialized(idx.load()) == want[idx.current()]

    assert check_crash_states(rec, tmp_path, check) > 10


def test_removing_everything_and_ivf_sq(repo):
    small = faiss.IndexIDMap(faiss.IndexFlatL2(4))
    small.add_with_ids(X[:30, :4].copy(), np.arange(30))
    idx = luopan.index.IndexStore(repo, "small")
    idx.snapshot(small)
    small.remove_ids(np.arange(30))  # an empty live array over a pool of 30 rows
    v = idx.snapshot(small)
    assert idx.manifest(v)["rowmaps"][0]["rows"] == 0 and serialized(idx.load(v)) == serialized(small)
    small.add_with_ids(X[:3, :4].copy(), np.arange(3) + 900)
    v = idx.snapshot(small)
    assert serialized(idx.load(v)) == serialized(small)
    sq = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatL2(D), D, 16, faiss.ScalarQuantizer.QT_8bit)
    sq.train(X[:4000])
    sq.add(X[:4000])
    idx = luopan.index.IndexStore(repo, "sq")
    idx.snapshot(sq)
    sq.remove_ids(np.arange(0, 4000, 50))
    v = idx.snapshot(sq)
    assert idx.manifest(v)["rowmaps"] and serialized(idx.load(v)) == serialized(sq)


def test_row_map_arithmetic():
    from luopan.index.rowmap import compress, expand, match

    idx = np.array([5, 6, 7, 0, 1, 9, 3, 4], dtype=np.int64)
    runs = compress(idx)
    assert runs.tolist() == [[5, 3], [0, 2], [9, 1], [3, 2]]
    assert expand(runs).tolist() == idx.tolist() and expand(compress(idx[:0])).tolist() == []
    pool = np.array([[1, 1], [2, 2], [2, 2], [3, 3], [4, 4]], dtype=np.uint8)  # rows 1 and 2 are equal
    live = np.array([[2, 2], [2, 2], [9, 9], [4, 4], [1, 1]], dtype=np.uint8)
    got = match([pool], [live])
    assert got.tolist() == [1, 2, -1, 4, 0]  # a duplicate continues the run; an unknown row is -1
    assert all((pool[g] == live[i]).all() for i, g in enumerate(got) if g >= 0)

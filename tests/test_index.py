"""luopan.index: FAISS index snapshots as a kind on the repository core (docs/format.md §17)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import luopan
from luopan.errors import (
    ArgumentTypeError,
    CorruptManifestError,
    CorruptRepoError,
    IntegrityError,
    InvalidNameError,
    ManifestNotFoundError,
    UsageError,
)
from luopan.format.canonical import seal, unseal
from luopan.index.extents import Gathered, plan_extents

from .conftest import PYTHON

faiss = pytest.importorskip("faiss")

D = 32
RNG = np.random.default_rng(7)
X = RNG.standard_normal((4000, D)).astype("float32")
Q = RNG.standard_normal((50, D)).astype("float32")


def ivf_flat(x=X, nlist=32):
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, nlist)
    index.train(x[:2000])
    index.add(x)
    index.nprobe = 6
    return index


def make(kind):
    if kind == "flat_l2":
        index = faiss.IndexFlatL2(D)
    elif kind == "flat_ip":
        index = faiss.IndexFlatIP(D)
    elif kind == "ivf_flat":
        return ivf_flat()
    elif kind == "ivf_pq":
        index = faiss.IndexIVFPQ(faiss.IndexFlatL2(D), D, 16, 8, 4)
        index.train(X)
        index.add(X)
        index.nprobe = 4
        return index
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(D, 8)
    elif kind == "idmap_flat":
        index = faiss.IndexIDMap(faiss.IndexFlatL2(D))
        index.add_with_ids(X, np.arange(len(X)) * 3 + 11)
        return index
    elif kind == "idmap2_ivf":
        sub = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 16)
        sub.train(X)
        index = faiss.IndexIDMap2(sub)
        index.add_with_ids(X, np.arange(len(X)) * 5 + 1)
        return index
    elif kind == "idmap2_hnsw":
        index = faiss.IndexIDMap2(faiss.IndexHNSWFlat(D, 8))
        index.add_with_ids(X, np.arange(len(X)) * 7)
        return index
    elif kind == "other_lsh":
        index = faiss.IndexLSH(D, 64)
    index.add(X)
    return index


def same_search(a, b):
    da, ia = a.search(Q, 10)
    db, ib = b.search(Q, 10)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_array_equal(da, db)


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(path) for f in fs)


KINDS = ["flat_l2", "flat_ip", "ivf_flat", "ivf_pq", "hnsw", "idmap_flat", "idmap2_ivf", "idmap2_hnsw", "other_lsh"]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_gives_identical_search_results(repo_path, kind):
    index = make(kind)
    before = faiss.serialize_index(index)
    with luopan.open(repo_path) as repo:
        idx = luopan.index.IndexStore(repo, "kb-main")
        v = idx.snapshot(index, params={"k": kind}, metadata={"note": "x"})
        assert v == 1 and idx.current() == 1 and idx.versions() == [1]
        assert np.array_equal(faiss.serialize_index(index), before)  # the index was left as it was found
        same_search(index, idx.load())
    with luopan.open(repo_path, create=False) as fresh:  # a new Repo object, as another process would
        idx = luopan.index.IndexStore(fresh, "kb-main")
        loaded = idx.load(1)
        assert type(loaded).__name__ == type(faiss.downcast_index(index)).__name__ or kind == "other_lsh"
        same_search(index, loaded)
        info = idx.info()
        assert info["params"] == {"k": kind} and info["metadata"] == {"note": "x"} and info["ntotal"] == len(X)
        fresh.verify()
    if kind.startswith("idmap"):
        np.testing.assert_array_equal(idx.ids(), faiss.vector_to_array(index.id_map))


def test_ids_are_kept_and_checked(repo):
    idx = luopan.index.IndexStore(repo, "kb")
    index = make("flat_l2")
    ids = np.arange(len(X), dtype=np.int64) * 2
    idx.snapshot(index, ids=ids)
    np.testing.assert_array_equal(idx.ids(), ids)
    with pytest.raises(UsageError, match="one id per vector"):
        idx.snapshot(index, ids=ids[:-1])
    with pytest.raises(ArgumentTypeError):
        idx.snapshot(index, ids=ids.astype(float))
    with pytest.raises(UsageError, match="IDMap"):
        idx.snapshot(make("idmap_flat"), ids=ids)
    with pytest.raises(UsageError, match="faiss index"):
        idx.snapshot(np.zeros((3, 3)))
    with pytest.raises(UsageError, match="JSON"):
        idx.snapshot(index, metadata={"x": object()})
    with pytest.raises(InvalidNameError):
        luopan.index.IndexStore(repo, "bad name")
    with pytest.raises(InvalidNameError):
        luopan.index.IndexStore(repo, "kb/log")
    assert idx.versions() == [1]


def test_sharing_between_snapshots_of_a_growing_ivf_index(repo_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((20_000, D)).astype("float32")
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 100)
    index.train(x[:5000])
    index.add(x)
    with luopan.open(repo_path) as repo:
        idx = luopan.index.IndexStore(repo, "kb")
        idx.snapshot(index)
        before = dir_bytes(repo_path)
        index.add(rng.standard_normal((200, D)).astype("float32"))  # 1% more
        assert idx.snapshot(index) == 2
        written = dir_bytes(repo_path) - before
        full = len(faiss.serialize_index(index))
        assert written * 20 < full, (written, full)
        same_search(index, luopan.index.IndexStore(luopan.open(repo_path, create=False), "kb").load())
        # an unchanged index costs no new chunk; a third growth reuses again
        assert idx.snapshot(index) == 3 and idx.info()["stats"]["new_chunks"] == 0
        index.add(rng.standard_normal((300, D)).astype("float32"))
        idx.snapshot(index)
        same_search(index, idx.load())


def test_sharing_for_flat_and_hnsw_growth(repo):
    for kind in ("flat_l2", "hnsw"):
        index = make(kind)
        idx = luopan.index.IndexStore(repo, kind)
        idx.snapshot(index)
        index.add(RNG.standard_normal((40, D)).astype("float32"))
        idx.snapshot(index)
        stats = idx.info()["stats"]
        # flat codes grow by appending; an HNSW graph also changes in place (its neighbor lists are rewritten)
        assert stats["new_bytes"] * (4 if kind == "flat_l2" else 2) < stats["logical_bytes"], (kind, stats)
        same_search(index, idx.load())


def test_extent_rule_reuses_verified_prefix_and_merges_small_tails():
    chunk = 1000
    data = bytearray(RNG.integers(0, 255, 3500, dtype=np.uint8).tobytes())
    first = plan_extents(Gathered([memoryview(bytes(data))]), [], chunk, lambda r: True)
    assert [(p.offset, p.size) for p in first] == [(0, 1000), (1000, 1000), (2000, 1000), (3000, 500)]
    import xxhash

    rows = [["0" * 64, 0, 0, p.size, p.size, "none", xxhash.xxh3_128_hexdigest(bytes(data[p.offset:p.offset + p.size]))]
            for p in first]
    grown = bytes(data) + b"\1" * 300
    second = plan_extents(Gathered([memoryview(grown)]), rows, chunk, lambda r: True)
    assert [p.row is not None for p in second] == [True, True, True, False]  # 500 + 300 merged: one new chunk
    assert (second[-1].offset, second[-1].size) == (3000, 800)
    changed = bytearray(grown)
    changed[1500] ^= 1  # a changed byte: that chunk is never reused
    third = plan_extents(Gathered([memoryview(bytes(changed))]), rows, chunk, lambda r: True)
    assert [p.row is not None for p in third][:3] == [True, False, True]
    split = Gathered([memoryview(grown[:1234]), memoryview(grown[1234:])])
    assert split.xxh3(1000, 1000) == rows[1][6] and bytes(split.view(1000, 1000)) == grown[1000:2000]


def test_rollback_current_versions_prune(repo):
    idx = luopan.index.IndexStore(repo, "kb")
    assert idx.current() is None and idx.versions() == []
    with pytest.raises(ManifestNotFoundError, match="no snapshot"):
        idx.load()
    index = make("flat_l2")
    copies = []
    for i in range(6):
        index.add(RNG.standard_normal((10, D)).astype("float32"))
        copies.append(faiss.clone_index(index))
        assert idx.snapshot(index) == i + 1
    assert idx.current() == 6 and idx.versions() == [1, 2, 3, 4, 5, 6]
    idx.rollback(2)
    assert idx.current() == 2
    same_search(copies[1], idx.load())
    with pytest.raises(ManifestNotFoundError, match="no version 9"):
        idx.rollback(9)
    with pytest.raises(UsageError):
        idx.rollback(0)
    idx.pin(1)
    removed = idx.prune(keep_last=2)
    assert removed == [3, 4] and idx.versions() == [1, 2, 5, 6]  # 1 pinned, 2 live, 5-6 newest
    assert idx.current() == 2
    same_search(copies[0], idx.load(1))
    with pytest.raises(UsageError):
        idx.prune(keep_last=0)


def test_gc_keeps_snapshot_packs_and_frees_them_after_prune(repo, repo_path):
    idx = luopan.index.IndexStore(repo, "kb")
    a, b = make("flat_l2"), make("flat_ip")
    b.add(RNG.standard_normal((4000, D)).astype("float32"))  # different data: own chunks
    idx.snapshot(a)
    idx.snapshot(b)
    packs = lambda: {f for _d, _s, fs in os.walk(repo_path / "packs") for f in fs}
    held = packs()
    repo.gc(grace=0)
    assert packs() == held
    same_search(a, idx.load(1))
    assert idx.prune(keep_last=1) == [1]
    report = repo.gc(grace=0)
    assert report.deleted_packs >= 1 and len(packs()) < len(held)
    same_search(b, idx.load())
    repo.verify()
    assert repo.du()["logical_bytes"] > 0


def test_verify_and_load_detect_a_damaged_chunk(repo, repo_path):
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(make("ivf_flat"))
    pack = next(os.path.join(d, f) for d, _s, fs in os.walk(repo_path / "packs") for f in fs)
    with open(pack, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="hash mismatch"):
        idx.verify()
    with pytest.raises(IntegrityError):
        idx.load()
    with pytest.raises(IntegrityError):
        repo.verify()


def test_damaged_manifest_and_ref_are_typed_errors(repo, repo_path):
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(make("hnsw"))
    key = repo_path / "indexes" / "kb" / "_v" / "00000001.json"
    doc = unseal(key.read_bytes())
    for mutate in (lambda d: d["entries"][0]["chunks"][0].__setitem__(4, 7),
                   lambda d: d.pop("stats"),
                   lambda d: d["entries"][1].__setitem__("shape", [5]),
                   lambda d: d["fields"].__setitem__("hnsw.entry_point", 10**9),
                   lambda d: d.__setitem__("name", "other"),
                   lambda d: d["entries"].pop()):
        bad = unseal(key.read_bytes()) if False else {**doc, "entries": [dict(e, chunks=[list(r) for r in e["chunks"]])
                                                                          for e in doc["entries"]],
                                                      "fields": dict(doc["fields"])}
        mutate(bad)
        key.write_bytes(seal(bad))
        with pytest.raises(CorruptManifestError):
            idx.load()
    key.write_bytes(b"{not json")
    with pytest.raises(CorruptManifestError):
        idx.manifest(1)
    ref = repo_path / "refs" / "indexes" / "kb" / "current.json"
    ref.write_bytes(b"garbage")
    with pytest.raises(CorruptRepoError, match="current.json"):
        idx.current()


def test_importing_luopan_does_not_import_faiss(child_env):
    code = "import sys, luopan; import luopan.index; assert 'faiss' not in sys.modules, 'faiss imported'"
    subprocess.run([PYTHON, "-c", code], check=True, env=child_env)


def test_snapshot_refs_and_layout_on_disk(repo, repo_path):
    idx = luopan.index.IndexStore(repo, "team/kb")
    idx.snapshot(make("flat_l2"))
    assert (repo_path / "indexes" / "team" / "kb" / "_v" / "00000001.json").is_file()
    ref = unseal((repo_path / "refs" / "indexes" / "team" / "kb" / "current.json").read_bytes())
    assert ref["version"] == 1 and ref["name"] == "team/kb" and ref["format_version"] == 4
    # 4 for the index kind, unless the config was already 8 for compression="auto" (the default, docs/format.md §3,
    # §5.2, §8.5)
    assert unseal((repo_path / "luopan.json").read_bytes())["format_version"] == (
        8 if repo.config.compression.codec == "auto" else 4)
    assert repo.resolve("team/kb@1")[0].name == "index"
    assert repo.strays(everywhere=True) == [] or all("indexes" not in s.key for s in repo.strays(everywhere=True))

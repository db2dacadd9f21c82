"""luopan.index review fixes: rollback to the live version keeps its logged ops, load() pairs the live version with
its own log start, a path is refused with a typed error, an HNSW whose top level disagrees with its entry point is a
CorruptManifestError, and the README snippet (README.md) runs as written."""

from __future__ import annotations

import os
import re
import subprocess

import numpy as np
import pytest

import luopan
from luopan.errors import ArgumentTypeError, CorruptManifestError
from luopan.format.canonical import seal, unseal

from .conftest import PYTHON, ROOT

faiss = pytest.importorskip("faiss")

D = 8
RNG = np.random.default_rng(11)
X = RNG.standard_normal((600, D)).astype("float32")


def flat(n=300):
    index = faiss.IndexFlatL2(D)
    index.add(X[:n])
    return index


def test_rollback_to_the_live_version_keeps_its_logged_ops(repo):
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(flat())
    idx.log_add([1, 2], X[300:302])
    assert idx.load().ntotal == 302
    idx.rollback(1)  # already live: a no-op, not a clean slate
    assert idx.current() == 1 and idx.load().ntotal == 302
    idx.snapshot(flat(310))
    idx.log_add([3], X[400:401])
    idx.rollback(1)  # another version: its ops start from nothing
    assert idx.load().ntotal == 300
    idx.close()


def test_load_reads_the_live_version_and_its_log_start_together(repo, monkeypatch):
    """A snapshot committed by someone else while load() runs must not pair the old version with the new ref's log
    start (which would drop the old version's logged ops from the result)."""
    idx = luopan.index.IndexStore(repo, "kb")
    idx.snapshot(flat())
    idx.log_add([7], X[500:501])
    other = luopan.index.IndexStore(repo, "kb")
    real = luopan.index.IndexStore.manifest
    fired = []

    def racing_manifest(self, version=None):
        doc = real(self, version)
        if self is idx and not fired:
            fired.append(other.snapshot(flat(320)))  # version 2 becomes live between the two reads
        return doc

    monkeypatch.setattr(luopan.index.IndexStore, "manifest", racing_manifest)
    loaded = idx.load()
    assert fired == [2]
    assert loaded.ntotal in (301, 320)  # version 1 with its op, or version 2: never version 1 without it
    monkeypatch.undo()
    assert idx.load().ntotal == 320
    idx.close()
    other.close()


def test_index_store_refuses_a_path_with_a_typed_error(repo_path):
    with pytest.raises(ArgumentTypeError, match="luopan.open"):
        luopan.index.IndexStore(str(repo_path), "kb")


def test_hnsw_top_level_must_be_the_entry_points(repo, repo_path):
    index = faiss.IndexHNSWFlat(D, 4)
    index.add(X)
    idx = luopan.index.IndexStore(repo, "h")
    idx.snapshot(index)
    h = index.hnsw
    levels = faiss.vector_to_array(h.levels)
    low = int(np.flatnonzero(levels == 1)[-1])  # a node only on level 0
    key = repo_path / "indexes" / "h" / "_v" / "00000001.json"
    good = unseal(key.read_bytes())
    for fields in ({"hnsw.entry_point": low, "hnsw.max_level": int(h.max_level)},  # top above the entry's level
                   {"hnsw.entry_point": int(h.entry_point), "hnsw.max_level": int(h.max_level) + 1},
                   {"hnsw.entry_point": -1, "hnsw.max_level": int(h.max_level)}):
        key.write_bytes(seal({**good, "fields": fields}))
        with pytest.raises(CorruptManifestError, match="HNSW graph"):
            idx.load()
    key.write_bytes(seal(good))
    got = idx.load()
    np.testing.assert_array_equal(got.search(X[:5], 4)[1], index.search(X[:5], 4)[1])
    empty = luopan.index.IndexStore(repo, "h0")
    empty.snapshot(faiss.IndexHNSWFlat(D, 4))
    assert empty.load().ntotal == 0


def test_readme_snippet_runs_as_written(tmp_path, child_env):
    docs = [os.path.join(ROOT, *p) for p in (("docs", "readme-index.md"), ("README.md",))]
    blocks = []
    for path in docs:
        if os.path.exists(path):
            with open(path) as f:
                blocks += re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    code = next(b for b in blocks if "luopan.index.IndexStore(" in b)
    res = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=child_env, capture_output=True, text=True, check=False,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "1 [1, 2, 3]"
    with luopan.open(tmp_path / "kb-repo", create=False) as repo:  # the version after remove_ids is a row map
        idx = luopan.index.IndexStore(repo, "kb-main")
        assert idx.manifest(3)["rowmaps"] and idx.info(3)["ntotal"] == 20_000 + 200 - 200
        assert idx.info(3)["stats"]["new_bytes"] < 0.1 * idx.info(3)["stats"]["logical_bytes"]

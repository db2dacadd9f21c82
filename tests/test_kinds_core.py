"""The repository core over the journal and index kinds: retention keeps an index's live version, du counts every
kind, gc keeps what each kind's manifests name."""

from __future__ import annotations

import numpy as np
import pytest

import luopan
from luopan.index.kind import INDEX_KIND
from luopan.repository.pruning import prune_series
from luopan.retention import KeepLast

faiss = pytest.importorskip("faiss", reason="faiss-cpu is a dev dependency (make setup installs it)")


def test_core_retention_keeps_the_live_index_version(tmp_path):
    repo = luopan.open(tmp_path / "r")
    idx = luopan.index.IndexStore(repo, "kb")
    x = np.random.default_rng(0).standard_normal((300, 8), dtype=np.float32)
    index = faiss.IndexFlatL2(8)
    for k in range(3):
        index.add(x[k * 100 : (k + 1) * 100])
        idx.snapshot(index)
    idx.rollback(1)
    plan = prune_series(repo, INDEX_KIND, "kb", KeepLast(1))  # what `luopan prune kb --keep-last 1` runs
    assert plan.remove == [2] and idx.versions() == [1, 3]
    assert idx.current() == 1
    repo.gc(grace=0)
    assert idx.load().ntotal == 100
    repo.verify()


def test_du_counts_every_kind(tmp_path):
    repo = luopan.open(tmp_path / "r")
    j = repo.journal("agent")
    j.append({"a": 1})
    j.compact({"state": 1})
    j.close()
    idx = luopan.index.IndexStore(repo, "kb")
    index = faiss.IndexFlatL2(4)
    index.add(np.ones((3, 4), dtype=np.float32))
    idx.snapshot(index)
    du = repo.du()
    assert du["journals"] == 1 and du["indexes"] == 1 and du["checkpoints"] == 0 and du["artifacts"] == 0
    assert repo.config.format_version == (8 if repo.config.compression.codec == "auto" else 4)  # "auto": 8 (§17.7)

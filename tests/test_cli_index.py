"""``luopan index ls|rollback`` through the real CLI app."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app

faiss = pytest.importorskip("faiss")


def run(*args, code=0):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res.output


def test_index_ls_and_rollback(tmp_path):
    repo_path = tmp_path / "repo"
    x = np.random.default_rng(0).standard_normal((500, 8)).astype("float32")
    index = faiss.IndexFlatL2(8)
    index.add(x)
    with luopan.open(repo_path) as repo:
        idx = luopan.index.IndexStore(repo, "kb-main")
        idx.snapshot(index, metadata={"model": "e5"})
        index.add(x[:10])
        idx.snapshot(index)
    run("init", "-r", tmp_path / "empty")
    assert "no indexes yet" in run("-r", tmp_path / "empty", "index", "ls")
    listing = json.loads(run("index", "ls", "-r", repo_path, "--json"))
    assert listing["indexes"] == [{"name": "kb-main", "live": 2, "versions": 2, "index_type": "IndexFlatL2",
                                   "ntotal": 510, "logical_bytes": listing["indexes"][0]["logical_bytes"]}]
    assert "kb-main" in run("-r", repo_path, "index", "ls")
    versions = json.loads(run("index", "ls", "kb-main", "-r", repo_path, "--json"))
    assert [(v["version"], v["live"], v["ntotal"]) for v in versions["versions"]] == [(1, False, 500), (2, True, 510)]
    assert versions["versions"][0]["metadata"] == {"model": "e5"}
    assert "(live)" in run("-r", repo_path, "index", "ls", "kb-main")
    out = json.loads(run("index", "rollback", "kb-main", "1", "-r", repo_path, "--json"))
    assert out == {"name": "kb-main", "version": 1, "previous": 2}
    assert "live version is now 2" in run("-r", repo_path, "index", "rollback", "kb-main", "2")
    run("-r", repo_path, "index", "rollback", "kb-main", "7", code=4)  # no such version
    run("-r", repo_path, "index", "ls", "nothing-here", code=4)
    run("-r", repo_path, "index", "rollback", "bad name", "1", code=2)  # invalid name: a usage error
    with luopan.open(repo_path, create=False) as repo:
        assert luopan.index.IndexStore(repo, "kb-main").current() == 2
    assert "index" in run("-r", repo_path, "du", "--json")
    run("-r", repo_path, "verify")
    run("-r", repo_path, "gc", "--grace", "0")

"""``luopan lineage link RUN@STEP NAME@V`` and ``repo.run(RUN).link_inputs(STEP, inputs)`` (issue 31, docs/format.md
§9.4): an input recorded afterwards, as a link file beside the checkpoint — the manifest's bytes never change; lineage (both ways)
lists it with the manifest's own inputs; typed errors that say what exists; idempotent; gc drops the link of a
removed checkpoint, and a checkpoint saved again at that step does not inherit it; every crash state of a link is
either no link or the whole link."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.errors import CheckpointNotFoundError, InvalidNameError, ManifestNotFoundError, UsageError
from luopan.format.names import manifest_key

from .crashstates import CrashState, check_crash_states
from .powerloss import Recorder


def _cli(*argv):
    return CliRunner().invoke(app, [str(a) for a in argv], catch_exceptions=False)


@pytest.fixture
def repo_path(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("a,b\n1,2\n")
    path = tmp_path / "repo"
    with luopan.open(path, progress=False) as r:
        r.artifact("datasets/train").commit(str(data))
        (data / "train.txt").write_text("a,b\n1,2\n3,4\n")
        r.artifact("datasets/train").commit(str(data), parents=["datasets/train@1"])
        w = np.random.default_rng(0).standard_normal(512).astype(np.float32)
        r.save("base", 10, {"w": w})
        r.save("ft", 1, {"w": w + 1})
        r.save("ft", 2, {"w": w + 2}, inputs=["base@10"])
    return path


def _manifest_bytes(path, run, step):
    with open(os.path.join(path, manifest_key(run, step)), "rb") as f:
        return f.read()


def test_link_from_the_cli_is_in_lineage_both_ways_and_the_manifest_is_untouched(repo_path):
    before = _manifest_bytes(repo_path, "ft", 2)
    res = _cli("lineage", "link", "-r", repo_path, "ft@2", "datasets/train@2")
    assert res.exit_code == 0, res.output
    assert "linked datasets/train@2 -> ft@2" in res.output
    assert _manifest_bytes(repo_path, "ft", 2) == before  # recorded beside it, never rewritten

    got = json.loads(_cli("lineage", "-r", repo_path, "ft@2", "--json").stdout)
    assert got["parents"] == ["base@10", "datasets/train@2"] and got["linked"] == ["datasets/train@2"]
    assert "datasets/train@1" in got["ancestors"]  # up the graph through the linked input
    text = _cli("lineage", "show", "-r", repo_path, "ft@2").stdout
    assert "<- datasets/train@2 (linked)" in text and "<- base@10\n" in text + "\n"

    used = json.loads(_cli("lineage", "-r", repo_path, "datasets/train@2", "--json").stdout)
    assert used["used_by"]["checkpoint"] == ["ft@2"]  # the dataset's "used by" includes the linked checkpoint
    with luopan.open(repo_path) as r:
        assert r.repository.lineage("datasets/train@2").checkpoints == ["ft@2"]
        assert r.repository.lineage("datasets/train@1").checkpoints == []


def test_python_api_is_idempotent_and_validates(repo_path):
    with luopan.open(repo_path) as r:
        assert r.run("ft").link_inputs(1, ["datasets/train@1", "base@10"]) == ["datasets/train@1", "base@10"]
        assert r.run("ft").link_inputs(1, ["datasets/train@1"]) == []  # again: nothing new
        assert r.run("ft").link_inputs(2, ["base@10"]) == []  # already in the manifest's own inputs
        assert r.repository.lineage("ft@1").parents == ["datasets/train@1", "base@10"]
        files = sorted(r.store.list("refs/links/"))
        assert len(files) == 2 and all(k.startswith("refs/links/ft/00000001/") for k in files)

        with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at step 7.*luopan ls ft"):
            r.run("ft").link_inputs(7, ["datasets/train@1"])
        with pytest.raises(ManifestNotFoundError, match=r"'datasets/train@9' does not exist.*luopan artifact ls"):
            r.run("ft").link_inputs(2, ["datasets/train@9"])
        with pytest.raises(InvalidNameError):
            r.run("ft").link_inputs(2, ["datasets/train@x"])
        with pytest.raises(UsageError, match="not the string"):
            r.run("ft").link_inputs(2, "datasets/train@1")
        with pytest.raises(UsageError, match="input of itself"):
            r.run("ft").link_inputs(2, ["ft@2"])
        assert len(list(r.store.list("refs/links/"))) == 2  # a refused call wrote nothing


def test_cli_errors_have_exit_codes(repo_path):
    assert _cli("lineage", "link", "-r", repo_path, "ft@9", "datasets/train@1").exit_code == 4
    assert _cli("lineage", "link", "-r", repo_path, "ft@2", "datasets/train@9").exit_code == 4
    assert _cli("lineage", "link", "-r", repo_path, "ft@x", "datasets/train@1").exit_code == 2
    res = _cli("lineage", "link", "-r", repo_path, "ft@2", "base@10", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout) == {"ref": "ft@2", "linked": [], "already": ["base@10"]}


def test_gc_drops_the_links_of_a_removed_checkpoint_and_a_new_save_does_not_inherit_them(repo_path):
    with luopan.open(repo_path) as r:
        r.run("ft").link_inputs(1, ["datasets/train@2"])
        r.run("ft").link_inputs(2, ["datasets/train@1"])
        r.delete("ft", 1)
        r.save("ft", 1, {"w": np.zeros(4, np.float32)})  # the same step again: another checkpoint
        assert r.repository.lineage("ft@1").parents == []
        assert r.repository.lineage("datasets/train@2").checkpoints == []
        report = r.gc(grace=0)
        assert report.dropped_links == 1
        assert [k.split("/")[2:4] for k in r.store.list("refs/links/")] == [["ft", "00000002"]]
        assert r.repository.lineage("ft@2").parents == ["base@10", "datasets/train@1"]  # kept


def test_every_crash_state_of_a_link_is_no_link_or_the_whole_link(tmp_path, repo_path):
    world = tmp_path / "w"
    os.rename(repo_path, world)  # the recorder watches one directory: the repository moves into it
    root = world

    def op(rec):
        r = luopan.open(root, progress=False)
        r.run("ft").link_inputs(1, ["datasets/train@2"])
        rec.ack("linked")
        r.close()

    with Recorder(str(world)) as rec:
        op(rec)

    def check(state: CrashState) -> None:
        with luopan.open(state.root, create=False, progress=False) as r:
            parents = r.repository.lineage("ft@1").parents
            assert parents in ([], ["datasets/train@2"]), parents
            if "linked" in state.acks:
                assert parents == ["datasets/train@2"]
            assert r.repository.lineage("ft@2").parents == ["base@10"]
            w = np.random.default_rng(0).standard_normal(512).astype(np.float32)
            np.testing.assert_array_equal(np.asarray(r.load("ft", 2)["w"]), w + 2)  # the checkpoint is untouched
            r.run("ft").link_inputs(1, ["datasets/train@2"])  # finishing it after the crash works
            assert r.repository.lineage("ft@1").parents == ["datasets/train@2"]

    assert check_crash_states(rec, tmp_path, check) > 3

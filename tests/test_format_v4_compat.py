"""Repositories written by luopan of format version 4 (tests/data/v4_repo/, made by tests/data/make_v4_repo.py with
commit 35180d9) still read exactly with this luopan, which can also add to them; and the manifests this luopan
writes with the format-5 features (row deltas with the cycle hint, XOR deltas) are refused as newer by a reader of
version 4, never misread."""

import datetime
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch

import luopan
import luopan.format

from .helpers import assert_exact, data_module

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SAMPLE = os.path.join(DATA, "v4_repo")


gen = data_module("make_v4_repo")


@pytest.fixture
def sample(tmp_path):
    """A private copy of the sample (a test must never modify tests/data)."""
    dest = tmp_path / "v4"
    shutil.copytree(SAMPLE, dest)
    return dest


def manifest_doc(root, run, step):
    with open(os.path.join(root, "runs", run, "ckpt", f"{step:08d}.json"), "rb") as f:
        return json.loads(f.read())


def test_the_sample_is_what_the_generator_describes():
    """Guards the sample itself: written by a version-4 luopan, with row deltas in older manifest versions."""
    with open(os.path.join(SAMPLE, "plain", "luopan.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == 4  # the journal raised it to 4
    train = [manifest_doc(os.path.join(SAMPLE, "plain"), "train", s) for s in gen.TRAIN_STEPS]
    ids = [manifest_doc(os.path.join(SAMPLE, "zstd"), "ids", s) for s in gen.IDS_STEPS]
    assert all(d["format_version"] <= 4 for d in train + ids)
    assert any("delta" in e for d in train for e in d["entries"])
    assert {d["format_version"] for d in ids if any("delta" in e for e in d["entries"])} == {2}
    assert not any("cycle" in e.get("delta", {}) for d in train + ids for e in d["entries"])  # a version-5 field
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(SAMPLE) for f in fs)
    assert total < 300 << 10


def test_every_checkpoint_of_a_v4_repository_loads_exactly(sample):
    repo = luopan.open(sample / "plain")
    assert repo.steps("train") == gen.TRAIN_STEPS and repo.steps("other") == gen.OTHER_STEPS
    for step in gen.TRAIN_STEPS:
        expected = gen.train_state(step)
        assert_exact(repo.load("train", step), expected)
        assert repo.manifest("train", step).metrics == {"loss": 1.0 / (step + 1)}
        target = gen.train_state(0)  # load_into overwrites the tensors in place
        target["model"]["emb"][:] = 0
        repo.load_into("train", target, step)
        assert_exact(target["model"], expected["model"])
    assert isinstance(repo.load("train", 3)["meta"]["started"], datetime.datetime)
    assert isinstance(repo.load("train", 3)["meta"]["data"], pathlib.PurePosixPath)
    for step in gen.OTHER_STEPS:
        assert_exact(repo.load("other", step), gen.other_state(step))
    assert repo.verify().ok
    repo.close()
    zrepo = luopan.open(sample / "zstd")
    for step in gen.IDS_STEPS:
        assert_exact(zrepo.load("ids", step), gen.ids_state(step))
    assert zrepo.verify().ok


def test_artifact_and_journal_of_a_v4_repository(sample, tmp_path):
    repo = luopan.open(sample / "plain")
    art = repo.artifact("dataset")
    assert art.numbers() == [1, 2]
    for version in (1, 2):
        out = art.checkout(tmp_path / f"co{version}", version)
        got = {os.path.relpath(os.path.join(d, f), out).replace(os.sep, "/"): pathlib.Path(d, f).read_bytes()
               for d, _, fs in os.walk(out) for f in fs}
        assert got.pop(".luopan-checkout.json")  # the checkout's record (docs/format.md §8.2.1)
        assert got == gen.artifact_files(version)
        assert art.get(version).metadata == {"version": version}
    assert art.verify(2) > 0
    journal = repo.journal("events")
    records = gen.journal_records()
    assert journal.snapshots() == [gen.SNAPSHOT_AT]
    snap = journal.latest_snapshot()
    assert snap.seq == gen.SNAPSHOT_AT and snap.value == gen.journal_snapshot()
    assert list(journal.read(gen.SNAPSHOT_AT)) == records[gen.SNAPSHOT_AT:]
    assert journal.last_seq == len(records) - 1
    seq = journal.append({"event": "new"})  # this luopan appends to the old log
    assert seq == len(records) and journal.get(seq) == {"event": "new"}
    journal.close()
    assert repo.verify().ok


def test_this_luopan_adds_checkpoints_to_a_v4_repository(sample):
    repo = luopan.open(sample / "plain", delta_policy=luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096))
    last = gen.TRAIN_STEPS[-1]
    state = gen.train_state(last)
    saved = {}
    for step in (last + 1, last + 2):  # the first save of this process starts from the v4 manifest on disk
        state["model"]["emb"][gen._rows(900 + step, 3)] += 1
        state["step"] = step
        repo.save("train", step, state)
        saved[step] = {"model": {k: v.clone() if isinstance(v, torch.Tensor) else v.copy()
                                 for k, v in state["model"].items()}}
    # this luopan's row deltas work on the old run (the first save may rebase: a version-4 delta has no cycle hint)
    assert "delta" in repo.manifest("train", last + 2).entry("model/emb")
    again = luopan.open(sample / "plain")  # a fresh process
    for step in gen.TRAIN_STEPS:
        assert_exact(again.load("train", step), gen.train_state(step))
    for step, expected in saved.items():
        assert_exact(again.load("train", step)["model"], expected["model"])
    assert again.verify().ok
    zrepo = luopan.open(sample / "zstd", delta_policy=luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096))
    ids = gen.ids_state(gen.IDS_STEPS[-1])
    ids["tok"][7] = -1
    zrepo.save("ids", 10, ids)
    assert_exact(luopan.open(sample / "zstd").load("ids", 10), ids)
    for step in gen.IDS_STEPS:
        assert_exact(zrepo.load("ids", step), gen.ids_state(step))
    assert zrepo.verify().ok


def _format5_repo(path):
    """A zstd repository (its config stays version 1): run "rows" holds a row delta, run "xor" an XOR delta."""
    repo = luopan.open(path, chunk_size=16 << 10, compression="zstd",
                       delta_policy=luopan.DeltaPolicy(min_bytes=4096, xor_min_bytes=4096))
    emb = np.random.default_rng(5).standard_normal((512, 32), dtype=np.float32)
    repo.save("rows", 0, {"emb": emb})
    emb[[3, 200, 411]] += 1  # a few rows: a row delta
    repo.save("rows", 1, {"emb": emb})
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    repo.save("xor", 0, {"w": w})
    w.mul_(1 + torch.randn(w.shape, generator=torch.Generator().manual_seed(6)) * 0.01)  # dense: an XOR delta
    repo.save("xor", 1, {"w": w})
    assert "delta" in repo.manifest("rows", 1).entry("emb")
    assert "xor" in repo.manifest("xor", 1).entry("w")
    assert repo.manifest("rows", 1).doc["format_version"] == repo.manifest("xor", 1).doc["format_version"] == 5
    repo.close()
    return {"rows": {"emb": emb}, "xor": {"w": w}}


@pytest.mark.parametrize("run", ["rows", "xor"])
def test_a_version_4_reader_refuses_format_5_manifests(tmp_path, monkeypatch, run):
    expected = _format5_repo(tmp_path / "r")
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 4)
    repo = luopan.open(tmp_path / "r")  # the config is version 1: a version-4 reader opens the repository
    assert list(repo.load(run, 0)) == list(expected[run])  # the full checkpoint (version 1) still reads
    with pytest.raises(luopan.UnsupportedFormatError, match=r"format_version 5, newer than this luopan reads \(4\)"):
        repo.load(run, 1)
    with pytest.raises(luopan.UnsupportedFormatError, match="newer"):
        repo.load_into(run, copy_tree(expected[run]), 1)
    monkeypatch.undo()
    assert_exact(luopan.open(tmp_path / "r").load(run, 1), expected[run])


def copy_tree(tree):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in tree.items()}

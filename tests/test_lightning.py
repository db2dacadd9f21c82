"""luopan.lightning (issue 12, part 4): Lightning's Trainer saves through luopan, resumes from it (also after a
SIGKILL mid-run) to the same weights as an uninterrupted run, rotates top-k checkpoints, and loads a module."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import luopan
from luopan.lightning import LuopanCheckpointIO, load_from_checkpoint, read_pointer

from .conftest import PYTHON
from .lightning_job import Net, fit

JOB = os.path.join(os.path.dirname(__file__), "lightning_job.py")


@pytest.fixture(autouse=True)
def restore_determinism():
    """Trainer(deterministic=True) turns torch's deterministic algorithms on for the whole process: turn them back
    off afterwards, or later tests meet torch.empty filling memory (unsupported for some dtypes)."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def same_weights(a: Net, b: Net) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_fit_resume_last_topk_and_load(tmp_path):
    repo = str(tmp_path / "repo")
    full = fit(repo, str(tmp_path / "ck-a"), "full", 4)
    fit(repo, str(tmp_path / "ck-b"), "part", 2)
    resumed = fit(repo, str(tmp_path / "ck-b"), "part", 4, ckpt_path="last")
    assert same_weights(full, resumed)
    assert sorted(os.listdir(tmp_path / "ck-b")) == ["epoch=1-step=16.ckpt", "epoch=3-step=32.ckpt", "last.ckpt"]
    with luopan.open(repo) as r:
        assert r.steps("part") == [16, 32]  # top-k rotation removed the others (pointer and checkpoint)
        ckpt = r.load("part", 32)
        assert ckpt["global_step"] == 32 and ckpt["hyper_parameters"]["data_dir"] == \
            __import__("pathlib").Path("/data/train")  # a Path, stored without pickle
        r.verify()
    assert read_pointer(tmp_path / "ck-b" / "last.ckpt")["step"] == 32
    module = load_from_checkpoint(Net, tmp_path / "ck-b" / "last.ckpt")
    assert same_weights(module, resumed) and module.hparams.hidden == 8
    module = load_from_checkpoint(Net, repo, "part", 16)
    assert isinstance(module, Net)


def test_killed_mid_run_resumes_to_the_same_weights(tmp_path, child_env):
    repo, ck = str(tmp_path / "repo"), str(tmp_path / "ck")
    proc = subprocess.run([PYTHON, JOB, repo, ck, "killed", "4", "2"], env=child_env, capture_output=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]  # SIGKILL at the start of epoch 2
    with luopan.open(repo) as r:
        assert r.steps("killed")[-1] == 16  # epoch 1's checkpoint is the newest complete one
    resumed = fit(repo, ck, "killed", 4, ckpt_path="last")
    full = fit(str(tmp_path / "repo2"), str(tmp_path / "ck2"), "full", 4)
    assert same_weights(full, resumed)


def test_pointer_errors_are_clear(tmp_path):
    (tmp_path / "x.ckpt").write_text("not a pointer")
    io = LuopanCheckpointIO(tmp_path / "repo", "r")
    with pytest.raises(luopan.CorruptRepoError, match="not a luopan checkpoint pointer"):
        io.load_checkpoint(tmp_path / "x.ckpt")
    io.remove_checkpoint(tmp_path / "x.ckpt")  # not ours: left alone
    assert (tmp_path / "x.ckpt").exists()


def test_a_pointer_into_another_run_is_only_unlinked(tmp_path):
    repo = str(tmp_path / "repo")
    fit(repo, str(tmp_path / "ck"), "other", 1)
    pointer = tmp_path / "ck" / "last.ckpt"
    io = LuopanCheckpointIO(repo, "mine")
    io.remove_checkpoint(pointer)
    assert not pointer.exists()
    with luopan.open(repo) as r:
        assert r.steps("other") == [8]  # its checkpoint stays: the pointer named another run

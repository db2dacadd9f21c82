"""luopan.lightning done right (issue 31): every checkpoint records the monitored metric (and, with ExactResume,
every logged scalar), so `luopan ls --best val_loss` works; a checkpoint Lightning rotates out frees its own packs
at once; ExactResume makes a fit SIGKILLed mid-run resume to bitwise the weights of an uninterrupted one, with
dropout and a shuffled DataLoader (and without it, it does not)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app

from .conftest import PYTHON
from .lightning_exact_job import fit

JOB = os.path.join(os.path.dirname(__file__), "lightning_exact_job.py")


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


class Logged(Callback):
    """What Lightning logged and what ModelCheckpoint scored, at each save."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, float]] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        self.at[trainer.global_step] = {k: v.item() for k, v in trainer.callback_metrics.items()}


@pytest.mark.parametrize("exact", [True, False])
def test_metrics_are_recorded_and_ls_best_works(tmp_path, exact):
    repo = str(tmp_path / "repo")
    logged = Logged()
    fit(repo, str(tmp_path / "ck"), "m", 4, exact=exact, extra=[logged])
    with luopan.open(repo) as r:
        cps = {c.step: c.metrics for c in r.checkpoints("m")}
    assert cps and set(cps) <= set(logged.at)
    for step, metrics in cps.items():
        assert metrics["val_loss"] == pytest.approx(logged.at[step]["val_loss"], rel=1e-6)
        if exact:  # ExactResume hands over every scalar logged, not only the monitored one
            assert metrics["train_loss"] == pytest.approx(logged.at[step]["train_loss"], rel=1e-6)
    result = CliRunner().invoke(app, ["ls", "-r", repo, "m", "--best", "val_loss", "--json"])
    assert result.exit_code == 0, result.output
    best = min(cps, key=lambda s: cps[s]["val_loss"])
    assert json.loads(result.output)["step"] == best


def test_rotated_out_checkpoints_free_their_packs(tmp_path):
    repo = str(tmp_path / "repo")
    seen: dict[int, set[str]] = {}

    class Packs(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            with luopan.open(repo) as r:
                for s in r.steps("rot"):
                    seen.setdefault(s, set(r.checkpointing.manifest("rot", s).packs))

    fit(repo, str(tmp_path / "ck"), "rot", 6, extra=[Packs()])
    with luopan.open(repo) as r:
        kept = r.steps("rot")
        named = set().union(*(r.checkpointing.manifest("rot", s).packs for s in kept))
        present = {k.rsplit("/", 1)[-1][:-5] for k in r.store.list("packs/")}
        rotated = [s for s in seen if s not in kept]
        assert rotated, "the run rotated nothing out"
        for s in rotated:  # each rotated-out checkpoint's own packs are gone, at once
            assert not (seen[s] - named) & present
        r.verify()
        assert present <= named  # not even a small pack of callback state is left behind
        assert r.gc(grace=0, repack_below=0).deleted_packs == 0  # nothing was left for gc


def test_exact_resume_after_sigkill_is_bitwise(tmp_path, child_env):
    results = {}
    for exact in (True, False):
        tag = "exact" if exact else "plain"
        repo, ck = str(tmp_path / f"repo-{tag}"), str(tmp_path / f"ck-{tag}")
        proc = subprocess.run([PYTHON, JOB, repo, ck, "k", "4", "1" if exact else "0", "2"], env=child_env,
                              capture_output=True, timeout=300)
        assert proc.returncode == -9, proc.stderr.decode()[-3000:]  # SIGKILL at the start of epoch 2
        with luopan.open(repo) as r:
            assert r.steps("k")[-1] == 16  # epoch 1's checkpoint is the newest
        resumed = fit(repo, ck, "k", 4, exact=exact, ckpt_path="last")
        full = fit(str(tmp_path / f"full-{tag}"), str(tmp_path / f"fck-{tag}"), "f", 4, exact=exact)
        results[exact] = same_weights(resumed, full)
    assert results[True], "ExactResume: the resumed fit's weights differ from the uninterrupted fit's"
    assert not results[False], "without ExactResume the resume was exact too: the test would not catch a regression"


def test_exact_resume_state_round_trips_without_pickle(tmp_path):
    repo = str(tmp_path / "repo")
    fit(repo, str(tmp_path / "ck"), "s", 2)
    with luopan.open(repo) as r:
        state = r.load("s")["callbacks"]["luopan.ExactResume"]
    assert set(state) == {"rng", "metrics"} and isinstance(state["rng"]["torch"], torch.Tensor)


def test_readme_example_runs_as_written(tmp_path, child_env):
    from .test_readme_agent import block, run_python

    out = run_python(block("python", "from luopan.lightning import ExactResume"), tmp_path, child_env)
    steps, best = out.strip().splitlines()[-1].rsplit("] ", 1)  # the last line: Lightning prints its own above
    steps = [int(s) for s in steps.strip("[").split(",")]
    assert int(best) in steps and steps[-1] == 40  # 5 epochs of 8 batches; top-2 by val_loss and last kept
    result = CliRunner().invoke(app, ["ls", "run-a", "--best", "val_loss", "-r", str(tmp_path / "ckpts"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["step"] == int(best)
    with luopan.open(tmp_path / "ckpts") as r:
        named = set().union(*(r.checkpointing.manifest("run-a", s).packs for s in r.steps("run-a")))
        present = {k.rsplit("/", 1)[-1][:-5] for k in r.store.list("packs/")}
    assert present <= named  # rotated-out checkpoints left no pack behind

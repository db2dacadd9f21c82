"""The resume check (luopan.checkpoint.runs.resumes): after restore(), the first steps of the resumed run are compared with
the metrics the interrupted run journaled; each resume and its outcome is recorded and listed by list_resumes."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import luopan
from luopan.checkpoint.runs.resumes import ResumeCheck, RunJournal, journal_name, list_resumes
from luopan.errors import UsageError
from luopan.policies import EveryNSteps
from luopan.torch import CheckpointManager, TrainingState


def _train_step(model, opt, step):
    g = torch.Generator().manual_seed(step)  # the data depends on the step only
    x = torch.randn(8, 4, generator=g)
    y = x.sum(1, keepdim=True)
    out = model(x) + 0.1 * torch.randn(8, 1)  # noise from the global RNG: a resume must restore it
    loss = (out - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _life(repo, until, *, rng=True, reseed=None, check=True):
    """One life of the run: build the model, restore, train up to step ``until``; returns (start, losses)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainingState(model=model, optimizer=opt, rng=rng)
    mgr = CheckpointManager(repo, "run", state, policy=EveryNSteps(10), resume_check=check)
    if reseed is not None:
        torch.manual_seed(reseed)
    start = mgr.restore()
    losses = {}
    for step in range(start, until):
        losses[step + 1] = _train_step(model, opt, step)
        mgr.maybe_save(step + 1, metrics={"loss": losses[step + 1]})
    mgr.close()  # or killed: the journal holds every step logged (a process crash loses none)
    return start, losses


def test_an_exact_resume_matches_and_a_lost_rng_diverges(repo, caplog):
    caplog.set_level(logging.INFO, logger="luopan")
    start, first = _life(repo, 37)  # checkpoints at 10, 20, 30; "interrupted" at 37
    assert start == 0 and repo.steps("run") == [10, 20, 30]
    assert list_resumes(repo, "run") == []

    start, second = _life(repo, 45)  # resumed from 30, RNG restored: bit for bit
    assert start == 30
    assert all(second[s] == first[s] for s in range(31, 38))
    [ok] = list_resumes(repo, "run")
    assert ok["step"] == 30 and ok["matched"] is True and ok["first_divergent_step"] is None
    assert ok["steps_compared"] == 7 and ok["restore_seconds"] > 0 and ok["time"].startswith("20")
    assert any("matches the interrupted run for 7 steps" in r.getMessage() for r in caplog.records)

    # Resumed again from 40, but the global RNG is reseeded and not restored: the noise differs from step 41 on.
    with pytest.warns(UserWarning, match=r"resumed from step 40 diverged from the interrupted run at step 41 \(loss"):
        start, third = _life(repo, 50, rng=False, reseed=123)
    assert start == 40 and third[41] != second[41]
    with luopan.open(repo.store.root) as other:  # a second reader of the same repository
        ok_again, bad = list_resumes(other, "run")
    assert ok_again == ok
    assert bad["step"] == 40 and bad["matched"] is False and bad["first_divergent_step"] == 41
    assert bad["steps_compared"] == 1 and "loss" in bad["detail"]
    assert any(r.levelno == logging.WARNING and "diverged" in r.getMessage() for r in caplog.records)
    assert set(bad) >= {"step", "time", "restore_seconds", "matched", "first_divergent_step", "steps_compared"}

    # `luopan show RUN` lists each resume and whether it matched (text and --json).
    from typer.testing import CliRunner

    from luopan.cli.main import app

    res = CliRunner().invoke(app, ["show", "-r", str(repo.store.root), "run"])
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("resume")]
    assert len(lines) == 2
    assert "from step 30" in lines[0] and "matched the interrupted run over 7 steps" in lines[0]
    assert "from step 40" in lines[1] and "DIVERGED from the interrupted run at step 41" in lines[1]
    res = CliRunner().invoke(app, ["show", "-r", str(repo.store.root), "run", "--json"])
    assert res.exit_code == 0, res.output
    listed = json.loads(res.output)["resumes"]
    assert [(x["step"], x["matched"], x["first_divergent_step"]) for x in listed] == [(30, True, None), (40, False, 41)]


def test_the_window_and_a_tolerance(repo):
    _life(repo, 25)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainingState(model=model, optimizer=opt)
    with CheckpointManager(repo, "run", state, policy=EveryNSteps(10),
                           resume_check=ResumeCheck(steps=3, rtol=1e-6)) as mgr:
        start = mgr.restore()
        for step in range(start, 30):
            loss = _train_step(model, opt, step)
            mgr.log(step + 1, {"loss": loss * (1 + 1e-9)})  # within rtol
    [r] = list_resumes(repo, "run")
    assert (r["step"], r["matched"], r["steps_compared"]) == (20, True, 3)


def test_not_enough_steps_is_undecided(repo):
    _life(repo, 10)  # interrupted right after the checkpoint at 10: nothing after it to compare with
    _life(repo, 10)  # restores 10, runs no step
    _life(repo, 14)  # restores 10, runs 4 steps: nothing logged after 10 before → undecided
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    with CheckpointManager(repo, "run", state, policy=EveryNSteps(10)) as mgr:
        assert mgr.restore() == 10  # steps 11..14 were logged: the run stops before logging any of them again
    rs = list_resumes(repo, "run")
    assert [(r["step"], r["matched"], r["steps_compared"]) for r in rs] == [(10, None, 0)] * 3
    assert "logged no metrics after step 10" in rs[0]["detail"]
    assert "stopped before any step" in rs[2]["detail"]


def test_resume_check_off_journals_nothing(repo):
    _life(repo, 15, check=False)
    _life(repo, 18, check=False)
    assert list_resumes(repo, "run") == []
    assert not os.path.exists(os.path.join(repo.store.root, "journals"))


def test_a_later_life_supersedes_the_steps_it_ran_again(repo):
    j = RunJournal(repo, "x", ResumeCheck())
    j.resumed(0, 0.0)
    for s in range(1, 11):
        j.log(s, {"loss": float(s)})
    with pytest.warns(UserWarning, match="diverged .* at step 6"):
        j.resumed(5, 0.01)
        for s in range(6, 9):
            j.log(s, {"loss": 100.0 + s, "other": "x"})
    j.resumed(5, 0.02)  # what life 2 logged for 6..8 is the reference now; life 1's 9 and 10 were run again too
    for s in range(6, 9):
        j.log(s, {"loss": 100.0 + s})
    j.close()
    rs = list_resumes(repo, "x")
    assert [(r["step"], r["matched"], r["first_divergent_step"], r["steps_compared"]) for r in rs] == [
        (5, False, 6, 1), (5, True, None, 3)]


def test_values_compared(repo):
    c = ResumeCheck()
    assert c.agree(1.5, 1.5) and not c.agree(1.5, 1.5000000001) and c.agree("NaN", "NaN") and c.agree("a", "a")
    assert not c.agree(1.0, "NaN") and c.agree(True, True) and not c.agree(1, True)
    assert ResumeCheck(atol=0.1).agree(1.0, 1.05) and ResumeCheck(rtol=0.1).agree(10.0, 10.9)
    for bad in ({"steps": 0}, {"rtol": -1.0}, {"atol": float("nan")}):
        with pytest.raises(UsageError):
            ResumeCheck(**bad)
    assert journal_name("metrics-", "a") == "metrics-a"
    long = journal_name("resumes-", "r" * 128)
    assert len(long) <= 128 and long.startswith("resumes-rrr") and long != journal_name("resumes-", "r" * 127 + "s")


def test_list_resumes_needs_no_torch(repo_path, child_env):
    luopan.open(repo_path).close()
    code = ("import sys; from luopan.checkpoint.runs.resumes import list_resumes; "
            f"print(list_resumes({str(repo_path)!r}, 'run')); assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_step_logged_several_times_is_compared_by_its_last_values(repo):
    """Gradient accumulation logs a step once per micro-batch: both runs are compared on the step's last values."""
    j = RunJournal(repo, "acc", ResumeCheck())
    j.resumed(0, 0.0)
    for s in range(1, 21):
        for micro in range(4):
            j.log(s, {"loss": float(s * 10 + micro)})
    j.close()
    j = RunJournal(repo, "acc", ResumeCheck())
    j.resumed(10, 0.0)
    for s in range(11, 21):
        for micro in range(4):
            j.log(s, {"loss": float(s * 10 + micro)})
    j.close()
    [r] = list_resumes(repo, "acc")
    assert (r["matched"], r["first_divergent_step"], r["steps_compared"]) == (True, None, 10)


def test_by_default_only_losses_are_compared_when_a_step_has_one(repo):
    j = RunJournal(repo, "t", ResumeCheck())
    j.resumed(0, 0.0)
    for s in range(1, 9):
        j.log(s, {"loss": float(s), "step_time": 0.1 * s, "lr": 0.01})
    j.close()
    j = RunJournal(repo, "t", ResumeCheck())
    j.resumed(4, 0.0)
    for s in range(5, 9):
        j.log(s, {"loss": float(s), "step_time": 7.0 + s, "lr": 0.02})  # wall-clock and lr differ, the loss does not
    j.close()
    j = RunJournal(repo, "t", ResumeCheck(metrics=("loss", "lr")))  # named metrics: exactly those
    with pytest.warns(UserWarning, match=r"diverged .* at step 7 \(lr"):
        j.resumed(6, 0.0)
        for s in range(7, 9):
            j.log(s, {"loss": float(s), "lr": 0.5})
        j.close()
    assert [(r["matched"], r["first_divergent_step"]) for r in list_resumes(repo, "t")] == [(True, None), (False, 7)]


def test_a_damaged_metrics_journal_or_odd_metrics_never_fail_the_loop(repo, monkeypatch):
    from luopan.checkpoint.runs import resumes
    from luopan.errors import CorruptJournalError

    j = RunJournal(repo, "d", ResumeCheck())
    j.resumed(0, 0.0)
    for s in range(1, 30):
        j.log(s, {"loss": float(s), "note": "bad\udc80"})  # a lone surrogate: left out of the record, no error
    j.close()
    # A journal that reads as damaged (what walscan raises for a segment damaged before durable records): the
    # restore goes on without the check, and later logs raise nothing.
    def damaged(*_a, **_k):
        raise CorruptJournalError("journal segment x is damaged at offset 40")

    monkeypatch.setattr(resumes, "_logged_after", damaged)
    j = RunJournal(repo, "d", ResumeCheck())
    with pytest.warns(UserWarning, match="resume check is off, its metrics journal cannot be read"):
        j.resumed(10, 0.0)
    j.log(11, {"loss": 11.0})
    j.close()
    monkeypatch.setattr(type(repo), "journal", damaged)  # and one that cannot even be opened
    j = RunJournal(repo, "d2", ResumeCheck())
    with pytest.warns(UserWarning, match="resume check is off, its metrics journal cannot be written"):
        j.log(1, {"loss": 1.0})
    j.resumed(5, 0.0)
    j.log(6, {"loss": 6.0})
    j.close()


def test_rm_of_a_run_removes_its_resume_journals(repo):
    """`luopan rm RUN` takes the run's metrics and resumes journals with it: a new run of that name starts clean."""
    from luopan.checkpoint.removal import remove

    start, _ = _life(repo, 25)
    _life(repo, 30)
    assert len(list_resumes(repo, "run")) == 1
    journals = os.path.join(repo.store.root, "journals")
    assert sorted(os.listdir(journals)) == ["metrics-run", "resumes-run"]
    dry = remove(repo, "run", dry_run=True)
    done = remove(repo, "run")
    assert done.files == dry.files > 0
    assert list_resumes(repo, "run") == []
    assert [f for _root, _dirs, files in os.walk(journals) for f in files] == []  # (empty directories may stay)
    start, _ = _life(repo, 12)  # a new run of the same name: nothing to resume, nothing compared
    assert start == 0 and list_resumes(repo, "run") == []

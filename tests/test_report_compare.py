"""The report compares runs: every journaled step of each run overlaid per metric (not only checkpoint points),
the runs' configs side by side with the differing keys highlighted, evals per checkpoint with the best marked; and
``luopan diff`` / ``repo.diff`` give per tensor the size of the change (checked against torch) and the config diff.
The page in a real browser: tests/test_report_browser.py."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch

import luopan
from luopan.policies import EveryNSteps
from luopan.report import build_report
from luopan.torch import CheckpointManager, TrainingState

from .test_report import parse

STEPS = 400  # logged steps per run
EVERY = 50  # a checkpoint every 50 steps: 8 of the 400 points
RUNS = {"lr-hi": {"lr": 0.05, "batch": 16, "optim": {"name": "sgd", "momentum": 0.9}},
        "lr-lo": {"lr": 0.01, "batch": 16, "optim": {"name": "sgd", "momentum": 0.0}}}
DIFFERING = {"config.lr", "config.optim.momentum", "state.extras.hyper_parameters.lr"}


def train(path, run: str, config: dict) -> None:
    """A tiny real training loop: CheckpointManager journals every step's loss, saves every EVERY steps with the
    run's config; the state holds Lightning-style hyper_parameters; an eval log every other checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["optim"]["momentum"])
    state = TrainingState(model=model, optimizer=opt, extras={"hyper_parameters": {"lr": config["lr"], "hidden": 4}})
    x, y = torch.randn(64, 4), torch.randn(64, 2)
    with CheckpointManager(path, run, state, policy=EveryNSteps(EVERY), config=config) as mgr:
        for step in range(mgr.restore(), STEPS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.maybe_save(step + 1, metrics={"loss": loss.item(), "grad_norm": float(model.weight.grad.norm())})
    repo = luopan.open(path, create=False)
    try:
        for i, step in enumerate(range(EVERY, STEPS + 1, 2 * EVERY)):
            repo.run(run).log_eval(step, {"acc": 0.5 + (0.1 if run == "lr-hi" else 0.05) * i})
    finally:
        repo.close()


def make_compare_repo(path) -> str:
    for run, config in RUNS.items():
        train(path, run, config)
    return str(path)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    return make_compare_repo(tmp_path_factory.mktemp("compare") / "repo")


def test_overlay_has_every_logged_step_of_every_run(compared):
    r = luopan.open(compared, create=False)
    try:
        page, data = build_report(r)
    finally:
        r.close()
    c = parse(page)
    assert [len(r.checkpoints) for r in data.runs] == [STEPS // EVERY] * 2
    for metric in ("loss", "grad_norm"):
        svg = c.find("svg", data_chart=f"overlay-{metric}")
        assert len(svg) == 1
        lines = c.find("path", class_="line")
        lines = [a for a in lines if a.get("data-run") in RUNS]
        by_chart: dict = {}
        chart = None
        for tag, a in c.tags:
            if tag == "svg":
                chart = a.get("data-chart")
            elif chart == f"overlay-{metric}" and tag in ("path", "circle") and a.get("data-run"):
                by_chart.setdefault((tag, a["data-run"]), []).append(a)
        for run in RUNS:
            assert len(by_chart[("path", run)]) == 1  # one series per run
            pts = by_chart[("circle", run)]
            assert sorted(int(a["data-step"]) for a in pts) == list(range(1, STEPS + 1))  # all 400, not 8
            ckpts = sorted(int(a["data-step"]) for a in pts if a.get("data-ckpt"))
            assert ckpts == list(range(EVERY, STEPS + 1, EVERY))
        assert len(lines) >= 2
    # the journaled values themselves: the loss the loop reported at step 1 and 400
    r = luopan.open(compared, create=False)
    try:
        journal = dict(next(x for x in data.runs if x.name == "lr-hi").logged["loss"])
        assert journal[STEPS] == r.manifest("lr-hi", STEPS).metrics["loss"]
    finally:
        r.close()
    assert any(t.startswith("lr-lo step 123 · loss = ") for t in c.titles)  # hover names run, step, value


def test_config_table_marks_the_differing_keys(compared):
    r = luopan.open(compared, create=False)
    try:
        page, data = build_report(r)
    finally:
        r.close()
    c = parse(page)
    differs = {a["data-key"] for a in c.find("tr", class_="differs")}
    assert differs == DIFFERING
    same = {a["data-key"] for a in c.find("tr", class_="same")}
    assert {"config.batch", "config.optim.name", "state.extras.hyper_parameters.hidden"} <= same
    assert not same & differs


def test_evals_per_checkpoint_with_the_best_marked(compared):
    r = luopan.open(compared, create=False)
    try:
        page, data = build_report(r)
    finally:
        r.close()
    c = parse(page)
    rows = [a for a in c.find("tr") if a.get("data-step")]
    assert len(rows) >= 2 * (STEPS // EVERY)
    best = c.find("td", class_="best")
    run = next(x for x in data.runs if x.name == "lr-hi")
    loss = {cp.step: cp.metrics["loss"] for cp in run.checkpoints}
    best_loss = min(loss, key=loss.get)
    # the best cell of each score: highest acc (an eval log), lowest loss (the checkpoints)
    assert sum(1 for a in best if a["data-metric"] == "acc") == 2 and sum(
        1 for a in best if a["data-metric"] == "loss") == 2
    assert f'<tr data-step="{best_loss}"><th>lr-hi@{best_loss}</th>' in page


def readme_lines() -> list[str]:
    """The ``luopan`` command lines of the README's "## Report" bash block, as written (comments dropped)."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("\n## Report\n"):]
    section = section[:section.index("\n## ", 1)]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.startswith("luopan ")]


def test_readme_report_section_runs_as_written(compared, tmp_path, monkeypatch):
    """Every line of the README's report block on two real runs named as there; ``--serve`` (which runs until
    stopped) is checked by tests/test_report_browser.py::test_served_page_reloads_when_a_run_saves."""
    from typer.testing import CliRunner

    from luopan.cli.main import app
    os.symlink(compared, tmp_path / "ckpts")
    monkeypatch.chdir(tmp_path)
    lines = readme_lines()
    assert len(lines) == 5 and any("diff" in ln for ln in lines)
    runner = CliRunner()
    for line in lines:
        if "--serve" in line:
            continue
        res = runner.invoke(app, shlex.split(line)[1:])
        assert res.exit_code == 0, (line, res.output)
        if " diff " in line and "--json" in line:
            assert all(c["rel_l2"] is not None for c in json.loads(res.output)["changed"])
        elif " diff " in line:
            assert "rel L2" in res.output and "config.lr" in res.output
    assert 'data-chart="overlay-loss"' in (tmp_path / "report.html").read_text()
    assert 'class="differs"' in (tmp_path / "a.html").read_text()


def test_a_resumed_run_shows_its_latest_life(tmp_path):
    """Steps an interrupted life logged after the checkpoint it resumed from are superseded by the resumed life's
    (docs/format.md §16.4): the curve holds each step once, with the value the run finally went on from."""
    from luopan.report.logged import logged_metrics
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path / "repo", "run", TrainingState(model=model), policy=EveryNSteps(10)) as mgr:
        for step in range(1, 26):
            mgr.maybe_save(step, metrics={"loss": 1.0})  # the first life: killed after logging step 25
    with pytest.warns(UserWarning):  # the resume differs from the interrupted run: a warning, as it should
        with CheckpointManager(tmp_path / "repo", "run", TrainingState(model=model), policy=EveryNSteps(10)) as mgr:
            start = mgr.restore()
            assert start == 20
            for step in range(start + 1, 31):
                mgr.maybe_save(step, metrics={"loss": 2.0})
    r = luopan.open(tmp_path / "repo", create=False)
    try:
        loss = logged_metrics(r, "run")["loss"]
    finally:
        r.close()
    assert [s for s, _ in loss] == list(range(1, 31))
    assert all(v == (1.0 if s <= 20 else 2.0) for s, v in loss)

"""luopan prune / pin / unpin: retention applied to a repository (the decision logic is tested in test_retention)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.retention import KeepBest, KeepLast


def filled(path, n=10):
    repo = luopan.open(path)
    for s in range(1, n + 1):
        repo.save("a", s, {"x": np.full(4, s, np.float32)}, metrics={"loss": 0.01 if s == 4 else 1.0 / s})
    return repo


def test_prune_keeps_newest_pinned_latest_and_best_and_dry_run_matches(tmp_path):
    repo = filled(tmp_path / "r")
    repo.run("a").pin(2, tag="keep-me")
    rules = KeepLast(2) | KeepBest(1, "loss")
    dry = repo.prune("a", rules, dry_run=True)
    assert repo.steps("a") == list(range(1, 11))  # nothing removed
    real = repo.prune("a", rules)
    assert (dry.keep, dry.remove) == (real.keep, real.remove)
    assert repo.steps("a") == [2, 4, 9, 10] == real.kept
    assert repo.prune("a", rules).remove == []  # applying it again changes nothing
    for s in repo.steps("a"):
        assert np.array_equal(repo.load("a", s)["x"], np.full(4, s, np.float32))
    assert repo.verify("a").ok and repo.load("a")["x"][0] == 10  # latest still the newest


def test_pins(tmp_path):
    repo = filled(tmp_path / "r", 3)
    run = repo.run("a")
    run.pin(1)
    run.pin(3, tag="release")
    assert {s: p["tag"] for s, p in run.pins().items()} == {1: None, 3: "release"}
    with pytest.raises(luopan.CheckpointNotFoundError, match="no checkpoint at step 7"):
        run.pin(7)
    assert run.unpin(1) and not run.unpin(1)
    assert list(run.pins()) == [3]


def test_cli_prune_pin_unpin(tmp_path):
    root = str(tmp_path / "r")
    filled(root)
    cli = CliRunner()
    assert cli.invoke(app, ["pin", "-r", root, "a", "5", "--tag", "best"]).exit_code == 0
    r = cli.invoke(app, ["prune", "-r", root, "a", "--keep-last", "3", "--dry-run"])
    assert r.exit_code == 0 and "dry run: nothing removed" in r.stdout
    assert "keep    step  5" in r.stdout and "(pinned)" in r.stdout and "remove  step  1" in r.stdout
    assert luopan.open(root).steps("a") == list(range(1, 11))
    r = cli.invoke(app, ["prune", "-r", root, "a", "--keep-last", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["remove"] == [1, 2, 3, 4, 6, 7]
    assert luopan.open(root).steps("a") == [5, 8, 9, 10]
    r = cli.invoke(app, ["prune", "-r", root, "a"])
    assert r.exit_code == 2 and "no keep rule given" in r.output
    r = cli.invoke(app, ["prune", "-r", root, "a", "--keep-best", "3:"])
    assert r.exit_code == 2
    assert cli.invoke(app, ["prune", "-r", root, "nope", "--keep-last", "1"]).exit_code == 4
    assert cli.invoke(app, ["unpin", "-r", root, "a", "5"]).exit_code == 0
    assert cli.invoke(app, ["unpin", "-r", root, "a", "5"]).exit_code == 4

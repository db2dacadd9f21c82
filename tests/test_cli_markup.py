"""User text is printed as written, never as rich markup (issue 27 item 15): metric names, metadata values, the
command line, config, entry paths, artifact file names and metadata, pin tags and the repository and output paths
may hold ``[bold]``, ``[/x]`` or ``loss[train]``; every command prints them literally and exits 0 (run names cannot
hold brackets, so everything around them is tried instead)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app

RUN = "run-a"
NASTY = "[bold]b[/bold] [/x] [red]"
METRICS = {"loss[train]": 0.5, "acc[/x]": 0.25, "[bold]m[/]": 2}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("markup")
    repo_path = root / "re[bold]po[/x]"  # the repository's own path is user text too
    data = root / "da[/x]ta"  # '/' makes "[/x]" span two directories: the path holds it all the same
    (data / "sub[red]" / "b[").mkdir(parents=True)
    (data / "[bold]a.txt").write_text("a")
    (data / "sub[red]" / "b[/x].txt").write_text("b")
    argv = sys.argv
    sys.argv = ["train.py", "--tag", "[/x]", "--name=loss[train]"]
    try:
        repo = luopan.open(repo_path)
        repo.run(RUN).write_record(config={"opt[/x]": NASTY})
        rng = np.random.default_rng(0)
        state = {"w[/x]": rng.standard_normal((8, 8)).astype(np.float32), "[bold]b": np.zeros(4, np.float32)}
        repo.save(RUN, 1, state, metrics=METRICS, metadata={"note": NASTY})
        state["w[/x]"] += 1
        repo.save(RUN, 2, state, metrics=METRICS, metadata={"note": NASTY})
        repo.artifact("ds").commit(str(data), metadata={"src": NASTY})
        repo.close()
    finally:
        sys.argv = argv
    return root, str(repo_path)


def run_cli(*args: str):
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert "Traceback" not in result.output
    assert result.exit_code == 0, (args, result.exit_code, result.output)
    return result.output


def literal(output: str, *texts: str) -> None:
    for text in texts:
        assert text in output, f"{text!r} was not printed as written:\n{output}"


def test_runs_and_checkpoints_print_user_text_literally(env):
    root, repo = env
    literal(run_cli("ls", "-r", repo), repo)
    literal(run_cli("ls", RUN, "-r", repo), "loss[train]=0.5", "acc[/x]=0.25", "[bold]m[/]=2")
    literal(run_cli("ls", RUN, "--best", "loss[train]", "-r", repo), "loss[train]=0.5")
    out = run_cli("show", RUN, "-r", repo)
    literal(out, "loss[train]=0.5", "acc[/x]=0.25", json.dumps({"note": NASTY}), "--tag [/x] --name=loss[train]",
            json.dumps({"opt[/x]": NASTY}), "w[~1x]", "[bold]b")  # an entry path writes "/" in a key as "~1"
    literal(run_cli("show", RUN, "1", "-r", repo), "loss[train]", "w[~1x]")
    literal(run_cli("diff", RUN, "1", "2", "-r", repo), "w[~1x]")
    literal(run_cli("stats", "-r", repo), repo, "w[~1x]")
    literal(run_cli("stats", RUN, "-r", repo), "w[~1x]")
    run_cli("du", "-r", repo)
    run_cli("check", "-r", repo)
    run_cli("verify", "-r", repo)
    run_cli("doctor", "-r", repo)
    (root / "m[").mkdir()
    literal(run_cli("export", RUN, "-o", str(root / "m[/x].safetensors"), "-r", repo), "m[/x].safetensors")


def test_artifacts_print_user_text_literally(env):
    root, repo = env
    literal(run_cli("artifact", "ls", "-r", repo), repo)
    literal(run_cli("artifact", "ls", "ds", "-r", repo), "[bold]a.txt", "sub[red]/b[/x].txt")
    literal(run_cli("artifact", "log", "ds", "-r", repo), f"src={NASTY}")
    dest = root / "out[/x]" / "co[bold]"
    dest.parent.mkdir(parents=True)
    literal(run_cli("artifact", "checkout", "ds", str(dest), "-r", repo), str(dest))
    assert (dest / "sub[red]" / "b[/x].txt").read_text() == "b"
    literal(run_cli("artifact", "commit", "ds", str(root / "da[/x]ta"), "--meta", "k=[/x]", "-r", repo), "ds@2")
    literal(run_cli("artifact", "log", "ds", "-r", repo), "k=[/x]")
    run_cli("artifact", "verify", "ds", "-r", repo)


def test_pins_locks_and_gc_print_user_text_literally(env):
    _root, repo = env
    literal(run_cli("pin", RUN, "1", "--tag", "keep[this]", "-r", repo), "keep[this]")
    literal(run_cli("prune", RUN, "--keep-tag", "keep[this]", "--dry-run", "-r", repo), "keep[this]")
    run_cli("unpin", RUN, "1", "-r", repo)
    run_cli("locks", "-r", repo)
    run_cli("gc", "--dry-run", "-r", repo)


def test_an_error_naming_user_text_prints_it_literally(env):
    _root, repo = env
    result = CliRunner().invoke(app, ["ls", RUN, "--best", "nope[/x]", "-r", repo], catch_exceptions=False)
    assert result.exit_code == 2 and "nope[/x]" in result.output and "loss[train]" in result.output

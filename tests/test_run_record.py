"""Run records (written by a run's first save) and eval logs with per-sample outputs."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.torch import CheckpointManager, TrainingState


@pytest.fixture
def dirty_worktree(tmp_path, monkeypatch):
    wt = tmp_path / "code"
    wt.mkdir()

    def git(*args):
        subprocess.run(["git", *args], cwd=wt, check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "init")
    (wt / "train.py").write_text("lr = 0.1\n")
    git("add", "train.py")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "train")
    (wt / "train.py").write_text("lr = 0.3  # uncommitted change\n")
    (wt / "notes.txt").write_text("untracked\n")
    monkeypatch.chdir(wt)
    return wt


def test_first_save_records_the_run(tmp_path, dirty_worktree, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "abc")
    monkeypatch.setenv("MY_DB_PASSWORD", "pw")
    monkeypatch.setenv("LUOPAN_TEST_PLAIN", "visible")
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.3"])
    repo = luopan.open(tmp_path / "repo")
    assert repo.run("a").record() is None
    repo.save("a", 1, {"w": np.ones(3)})
    rec = repo.run("a").record()
    assert rec["run"] == "a" and rec["argv"] == ["train.py", "--lr", "0.3"]
    assert rec["packages"]["numpy"] == np.__version__ and "luopan" in rec["packages"]
    assert rec["git"]["dirty"] and "+lr = 0.3  # uncommitted change" in rec["git"]["diff"]
    assert rec["git"]["untracked_files"] == ["notes.txt"]
    env = rec["environment"]
    assert env["HF_TOKEN"] == env["AWS_SECRET_ACCESS_KEY"] == env["MY_DB_PASSWORD"] == "<redacted>"
    assert env["LUOPAN_TEST_PLAIN"] == "visible"
    assert "hf_secret" not in json.dumps(rec)
    created = rec["created"]
    repo.save("a", 2, {"w": np.zeros(3)})  # later saves keep the first record
    assert repo.run("a").record()["created"] == created
    assert repo.runs() == ["a"]  # a record is not a checkpoint


def test_manager_records_the_config_and_refuses_non_json_config(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(luopan.UnsupportedValueError, match="OmegaConf.to_container"):
        CheckpointManager(tmp_path / "r", "a", TrainingState(model=model), config={"fn": print})
    mgr = CheckpointManager(tmp_path / "r", "a", TrainingState(model=model),
                            config={"lr": 0.1, "layers": [2, 2], "name": "base"})
    mgr.save(1)
    mgr.close()
    assert luopan.open(tmp_path / "r").run("a").record()["config"] == {"lr": 0.1, "layers": [2, 2], "name": "base"}


def test_eval_logs_keep_per_sample_outputs(tmp_path):
    repo = luopan.open(tmp_path / "r")
    run = repo.run("a")
    samples = [{"prompt": "2+2", "output": "4", "score": 1.0}, {"prompt": "capital of France", "output": "Lyon",
                                                                  "score": 0.0}]
    run.log_eval(100, {"accuracy": 0.5, "loss": float("nan")}, samples=samples)
    run.log_eval(200, {"accuracy": 1.0})
    assert run.evals() == [100, 200]
    e = run.eval(100)
    assert e["samples"] == samples and e["metrics"]["accuracy"] == 0.5 and np.isnan(e["metrics"]["loss"])
    with pytest.raises(luopan.CheckpointExistsError, match="overwrite=True"):
        run.log_eval(100, {"accuracy": 0.7})
    run.log_eval(100, {"accuracy": 0.7}, overwrite=True)
    assert run.eval(100)["metrics"]["accuracy"] == 0.7
    with pytest.raises(luopan.UnsupportedValueError, match="JSON"):
        run.log_eval(300, {"accuracy": 1.0}, samples=[object()])
    with pytest.raises(luopan.CheckpointNotFoundError, match=r"no eval at step 5; it has: \[100, 200\]"):
        run.eval(5)
    with pytest.raises(luopan.InvalidNameError):
        repo.run("../x")


def test_cli_show_prints_the_record(tmp_path, dirty_worktree, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-123")
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"w": np.ones(3)})
    repo.run("a").log_eval(1, {"acc": 1.0}, samples=[{"out": "x"}])
    r = CliRunner().invoke(app, ["show", "-r", str(tmp_path / "r"), "a"])
    assert r.exit_code == 0, r.output
    assert "OPENAI_API_KEY" in r.output and "redacted" in r.output and "sk-123" not in r.output
    assert "dirty: " in r.output and "evals        steps 1" in r.output
    j = json.loads(CliRunner().invoke(app, ["show", "-r", str(tmp_path / "r"), "a", "--json"]).stdout)
    assert j["record"]["git"]["dirty"] and j["evals"] == [1]
    j1 = json.loads(CliRunner().invoke(app, ["show", "-r", str(tmp_path / "r"), "a", "1", "--json"]).stdout)
    assert "record" not in j1


def test_credentials_in_urls_and_secret_flags_are_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://admin:hunter2@db:5432/x")
    monkeypatch.setenv("LUOPAN_TEST_INDEX", "https://user:tok123@mirror.example/simple")
    monkeypatch.setattr(sys, "argv", ["train.py", "--hf_token", "hf_abc", "--api-key=sk-1", "--lr", "0.1",
                                      "--data", "s3://AKIA:secret@bucket/x"])
    monkeypatch.chdir(tmp_path)  # outside a git work tree (a diff of this test file would hold the strings)
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"w": np.ones(2)})
    rec = repo.run("a").record()
    assert rec["git"] is None
    text = json.dumps(rec)
    for secret in ("hunter2", "tok123", "hf_abc", "sk-1", "AKIA:secret"):
        assert secret not in text, secret
    assert rec["argv"] == ["train.py", "--hf_token", "<redacted>", "--api-key=<redacted>", "--lr", "0.1",
                           "--data", "s3://<redacted>@bucket/x"]
    assert rec["environment"]["DATABASE_URL"] == "postgres://<redacted>@db:5432/x"


def test_undecodable_bytes_never_fail_a_save(tmp_path, dirty_worktree, monkeypatch):
    (dirty_worktree / "train.py").write_bytes(b"lr = 0.3  # caf\xe9 in Latin-1\n")
    monkeypatch.setenv("LUOPAN_TEST_BYTES", b"\xff\xfe".decode("utf-8", "surrogateescape"))
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"w": np.ones(2)})
    rec = repo.run("a").record()
    assert "caf" in rec["git"]["diff"] and rec["environment"]["LUOPAN_TEST_BYTES"] == "\ufffd\ufffd"


def test_a_record_that_cannot_be_built_never_fails_or_hides_a_save(tmp_path, monkeypatch):
    from luopan.checkpoint.runs import record as runrecord

    def broken():
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(runrecord, "git_state", broken)
    repo = luopan.open(tmp_path / "repo")
    with pytest.warns(UserWarning, match="run record could not be written"):
        info = repo.save("a", 0, {"w": np.ones(3)})
    assert info.step == 0 and repo.steps("a") == [0] and repo.run("a").record() is None
    assert np.array_equal(repo.load("a")["w"], np.ones(3))
    repo.save("a", 1, {"w": np.zeros(3)})  # no second attempt in this process, and the next save is normal
    assert repo.steps("a") == [0, 1]

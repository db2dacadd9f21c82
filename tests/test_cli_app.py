"""The CLI's shared parts and the package surface: ``-r`` before or after the command, the one exit-code table, one
error hierarchy exported from ``luopan``, and ``import luopan`` reaching the modules the README uses."""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
import luopan.errors as errors_module
from luopan.cli.app import EXIT_CODES, exit_code_for
from luopan.cli.main import app


@pytest.fixture
def two_repos(tmp_path):
    paths = []
    for name in ("a", "b"):
        with luopan.open(tmp_path / name) as repo:
            repo.save(f"run-{name}", 1, {"x": np.arange(3)})
        paths.append(str(tmp_path / name))
    return paths


def invoke(*args, env=None):
    return CliRunner().invoke(app, list(args), env=env)


def test_repo_option_before_or_after_the_command(two_repos, monkeypatch):
    a, b = two_repos
    monkeypatch.delenv("LUOPAN_REPO", raising=False)
    assert "run-a" in invoke("-r", a, "ls").output  # restic/borg style
    assert "run-a" in invoke("ls", "-r", a).output
    assert "run-b" in invoke("--repo", a, "ls", "--repo", b).output  # the command's own -r wins
    assert "run-b" in invoke("ls", env={"LUOPAN_REPO": b}).output
    assert "run-a" in invoke("-r", a, "ls", env={"LUOPAN_REPO": b}).output  # a flag beats the environment
    assert invoke("-r", a, "show", "run-a", "1").exit_code == 0
    r = invoke("ls", env={"LUOPAN_REPO": ""})
    assert r.exit_code == 2 and "no repository given" in r.output


def test_every_error_class_has_one_exit_code_and_a_builtin_base():
    classes = [c for _n, c in inspect.getmembers(errors_module, inspect.isclass)
               if issubclass(c, luopan.LuopanError) and c is not luopan.LuopanError]
    assert len(classes) >= 25
    for cls in classes:
        builtins = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (object, Exception,
                                                                                        BaseException)]
        assert builtins, f"{cls.__name__} subclasses no built-in exception besides Exception"
        assert getattr(luopan, cls.__name__) is cls, f"{cls.__name__} is not exported from luopan"
        assert next(code for base, code in EXIT_CODES if issubclass(cls, base)) in (1, 2, 3, 4, 5)
    assert exit_code_for(luopan.UsageError("x")) == 2
    assert exit_code_for(luopan.InvalidNameError("x")) == 2  # a bad name the user typed: usage, as ds@0 is
    assert exit_code_for(luopan.CorruptManifestError("x")) == 3
    assert exit_code_for(luopan.GcError("x")) == 3
    assert exit_code_for(luopan.CheckpointNotFoundError("x")) == 4
    assert exit_code_for(luopan.UnsupportedFormatError("x")) == 5
    assert exit_code_for(luopan.ReplicationError("x")) == 1
    assert EXIT_CODES[-1][0] is OSError


def test_public_argument_errors_are_luopan_errors(tmp_path):
    from luopan.policies import EveryNSteps
    from luopan.retention import KeepBest, KeepLast, Retention

    for call in (lambda: luopan.open(tmp_path / "r", lock_timeout=-1), lambda: KeepLast(0),
                 lambda: KeepBest(1, "loss", "lowest"), lambda: EveryNSteps(0),
                 lambda: luopan.open(tmp_path / "r").gc(grace=-1), lambda: Retention(EveryNSteps(3)),
                 lambda: luopan.ColdPolicy("s3://b/x", older_than=-5).seconds):
        with pytest.raises(luopan.LuopanError):
            call()


def test_import_luopan_reaches_retention_policies_and_torch_lazily():
    code = ("import sys, luopan; assert 'torch' not in sys.modules; "
            "luopan.retention.KeepLast(2); luopan.policies.EveryNSteps(3); "
            "assert luopan.torch.CheckpointManager and 'torch' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

"""A malformed NAME@N argument (RUN@STEP, NAME@V) is a usage error: exit 2 with the message, as a bad flag is
(issue 27: ``ds@0`` exited 1). Every command that takes one goes through the CLI's one parser (cli.app.ref_argument)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("refs")
    (root / "data").mkdir()
    (root / "data" / "f.txt").write_text("x")
    with luopan.open(root / "repo") as r:
        r.save("run-a", 1, {"x": np.zeros(3, np.float32)})
        r.artifact("ds").commit(str(root / "data"))
    return root


BAD = [
    ("artifact", "ls", "ds@0"),
    ("artifact", "ls", "ds@x"),
    ("artifact", "checkout", "ds@0", "{root}/out"),
    ("artifact", "verify", "ds@-1"),
    ("artifact", "pin", "ds@0"),
    ("artifact", "unpin", "ds@1.5"),
    ("verify", "ds@0"),
    ("pin", "run-a@x"),
    ("unpin", "run-a@"),
    ("diff", "run-a@x", "run-a@1"),
    ("lineage", "ds@x"),
]


@pytest.mark.parametrize("args", BAD, ids=" ".join)
def test_a_malformed_reference_is_a_usage_error(repo, args):
    argv = [a.format(root=repo) for a in args] + ["-r", str(repo / "repo")]
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "Traceback" not in result.output
    assert not (repo / "out").exists()


def test_well_formed_references_still_work(repo):
    for argv in (["artifact", "ls", "ds@1"], ["verify", "ds@1"], ["lineage", "ds@1"], ["pin", "run-a@1"],
                 ["unpin", "run-a@1"]):
        result = CliRunner().invoke(app, argv + ["-r", str(repo / "repo")], catch_exceptions=False)
        assert result.exit_code == 0, (argv, result.output)
    result = CliRunner().invoke(app, ["lineage", "ds@7", "-r", str(repo / "repo")], catch_exceptions=False)
    assert result.exit_code == 4  # well formed, not there: not found, not a usage error

"""benchmarks/stacks_langgraph.py runs (two worker processes on one LuopanSaver repository and on one SqliteSaver file)
and reports E2 with its goal and raw figures; the figures themselves are for the benchmark, never timed here."""

from __future__ import annotations

import os
import sys

import pytest

from .conftest import ROOT

pytest.importorskip("langgraph.checkpoint.sqlite", reason="langgraph-checkpoint-sqlite is not installed")


def test_stacks_langgraph_reports_e2(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    sys.modules.pop("stacks_langgraph", None)
    import stacks_langgraph

    lines: list[str] = []
    results = stacks_langgraph.run(True, str(tmp_path), lines.append)
    assert [r["id"] for r in results] == ["E2.sqlite_bytes_over_luopan_two_workers"]
    r = results[0]
    assert r["goal"] == 10 and r["goal_op"] == ">=" and r["unit"] == "x"
    assert r["luopan_checkpoints"] == r["sqlite_checkpoints"] > 0  # both stores hold every worker's checkpoints
    assert r["value"] == r["sqlite_bytes"] / r["luopan_bytes"] > 1
    lost = r["steps_lost_to_kill"]
    assert lost["sync"]["steps_lost"] <= 1  # durability="sync": at most the step running when killed
    assert lost["exit"]["steps_saved"] == 0  # "exit": nothing of the interrupted invoke

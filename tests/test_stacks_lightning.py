"""benchmarks/stacks_lightning.py (issue 31, E1) runs on the tests' tiny Lightning run and reports its figures."""

from __future__ import annotations

import importlib.util
import os

from .conftest import ROOT


def test_e1_runs_and_reports(tmp_path):
    spec = importlib.util.spec_from_file_location("stacks_lightning", os.path.join(ROOT, "benchmarks",
                                                                                  "stacks_lightning.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines: list[str] = []
    (row,) = module.run(True, str(tmp_path), lines.append)
    assert row["id"] == "E1.lightning_bytes_over_default" and row["goal_op"] == "<=" and row["goal"] == 1.0
    assert row["value"] == row["ratio"] == row["luopan_bytes"] / row["default_bytes"]
    assert row["met"] == (row["value"] <= 1.0) and row["saves"] > 0 and lines
    assert row["luopan_seconds_per_save"] > 0 and row["default_seconds_per_save"] > 0

"""The FAISS part of the `stacks` suite (benchmarks/stacks_faiss.py) runs end to end at its --quick size and reports
E3 with its goal; the figure is a byte ratio (not a timing), so it is checked here too."""

from __future__ import annotations

import importlib.util
import os

import pytest

from .conftest import ROOT

pytest.importorskip("faiss")


def test_stacks_faiss_reports_e3(tmp_path):
    spec = importlib.util.spec_from_file_location("stacks_faiss", os.path.join(ROOT, "benchmarks", "stacks_faiss.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = []
    results = mod.run(True, str(tmp_path), lines.append)
    assert [r["id"] for r in results] == ["E3.write_index_over_luopan_with_deletes"]
    e3 = results[0]
    assert e3["goal"] == 5 and e3["goal_op"] == ">=" and e3["unit"] == "x"
    assert e3["value"] == e3["ratio"] > 0 and e3["met"] is (e3["value"] >= 5)
    assert e3["met"], e3  # bytes, not time: write_index writes a full file per version, luopan what changed
    assert len(e3["faiss_seconds_per_version"]) == len(e3["luopan_seconds_per_version"]) == e3["versions"]
    assert lines and os.listdir(tmp_path) == []  # it logs, and removes its scratch data

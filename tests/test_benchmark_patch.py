"""The patch benchmark suite (P9, P10, P11, P12) runs end to end at a tiny size and its JSON carries the three ids with
their goals; the figures themselves are checked by running the suite at full size, never by timed tests."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import PYTHON, ROOT


def test_patch_suite_runs_and_reports_its_ids(tmp_path, child_env):
    out = tmp_path / "patch.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "run.py"), "--suite", "patch", "--quick",
                           "--size-mib", "8", "--reps", "1", "--quiet", "--json", str(out), "--workdir",
                           str(tmp_path)], env=child_env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    results = {r["id"]: r for r in report["results"]}
    assert set(results) == {"P9.patch_bytes_over_changed", "P10.apply_vs_article", "P10.apply_vs_raw_write",
                            "P11.resume_waste", "P12.apply_peak_rss_mib"}
    assert results["P11.resume_waste"]["goal"] == 1.05 and results["P11.resume_waste"]["goal_op"] == "<="
    assert results["P9.patch_bytes_over_changed"]["goal"] == 1.05
    assert results["P10.apply_vs_article"]["goal"] == 3
    assert results["P10.apply_vs_raw_write"]["goal"] == 0.8
    assert results["P12.apply_peak_rss_mib"]["goal"] == 300
    assert not report["problems"], report["problems"]  # luopan's output is the export; the article's has its tensors
    assert results["P9.patch_bytes_over_changed"]["met"]  # a size ratio, not a timing: it holds at any size
    assert all(isinstance(r["value"], float) and r["value"] > 0 for r in results.values())
    assert os.listdir(tmp_path) == ["patch.json"]  # its scratch data is removed

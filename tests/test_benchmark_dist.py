"""The dist benchmark suite (DCP at world size 2, gloo) runs end to end at a tiny size and its JSON carries the three
ids with goals; the figures themselves are checked by running the suite at full size, never by timed tests."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import PYTHON, ROOT


def test_dist_suite_runs_and_reports_its_ids(tmp_path, child_env):
    out = tmp_path / "dist.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "run.py"), "--suite", "dist",
                           "--size-mib", "8", "--reps", "1", "--cold-reps", "0", "--quiet", "--json", str(out),
                           "--workdir", str(tmp_path)], env=child_env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    results = {r["id"]: r for r in report["results"]}
    assert set(results) == {"D1.dcp_first_save_vs_filesystem", "D2.dcp_resave_vs_filesystem",
                            "D3.ddp_bytes_over_state"}
    assert results["D1.dcp_first_save_vs_filesystem"]["goal"] == 1.0
    assert results["D2.dcp_resave_vs_filesystem"]["goal"] == 10
    assert results["D3.ddp_bytes_over_state"]["goal"] == 1.05
    assert not report["problems"], report["problems"]  # both sides' re-saves and the replicated save loaded back
    assert all(isinstance(r["value"], float) and r["value"] > 0 for r in results.values())
    assert os.listdir(tmp_path) == ["dist.json"]  # its scratch data is removed

"""The artifacts benchmark suite runs end to end (tiny sizes) and its JSON carries the three ids with goals; the
figures themselves are checked by running the suite at full size, never by timed tests."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import PYTHON, ROOT


def test_artifacts_suite_runs_and_reports_its_ids(tmp_path, child_env):
    out = tmp_path / "artifacts.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "run.py"), "--suite", "artifacts",
                           "--size-mib", "8", "--reps", "1", "--cold-reps", "0", "--quiet", "--json", str(out),
                           "--workdir", str(tmp_path)], env=child_env, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    results = {r["id"]: r for r in report["results"]}
    assert set(results) == {"A1.insert_bytes_over_inserted", "A2.commit_vs_copy", "A3.checkout_vs_copy"}
    assert results["A1.insert_bytes_over_inserted"]["goal"] == 2
    assert results["A2.commit_vs_copy"]["goal"] == results["A3.checkout_vs_copy"]["goal"] == 0.8
    assert not report["problems"], report["problems"]  # the checkout matched what was committed
    assert all(isinstance(r["value"], float) and r["value"] > 0 for r in results.values())
    assert os.listdir(tmp_path) == ["artifacts.json"]  # its scratch data is removed

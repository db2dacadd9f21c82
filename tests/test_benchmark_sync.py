"""The sync benchmark suite (SY1-SY5) runs end to end (--quick, a trainer and a subscriber process) and its JSON
carries the five ids with their goals; the figures themselves are checked by running the suite, never by timed
tests."""

from __future__ import annotations

import json
import os
import subprocess

from .conftest import PYTHON, ROOT


def test_sync_suite_runs_and_reports_its_ids(tmp_path, child_env):
    out = tmp_path / "sync.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "run.py"), "--suite", "sync", "--quick",
                           "--quiet", "--json", str(out), "--workdir", str(tmp_path)], env=child_env,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    results = {r["id"]: r for r in report["results"] if not r.get("context")}
    assert list(results) == ["SY1.bytes_over_floor", "SY2.bytes_over_full", "SY3.load_state_dict_over_apply",
                             "SY4.catchup_over_union", "SY5.publish_vs_safetensors_save"]
    goals = {k: (r["goal_op"], r["goal"]) for k, r in results.items()}
    assert goals == {"SY1.bytes_over_floor": ("<=", 1.25), "SY2.bytes_over_full": ("<=", 0.03),
                     "SY3.load_state_dict_over_apply": (">=", 2.0), "SY4.catchup_over_union": ("<=", 1.5),
                     "SY5.publish_vs_safetensors_save": (">=", 1.0)}
    assert all(isinstance(r["value"], float) and r["value"] > 0 for r in results.values())
    # sizes, not timings: they hold at any size
    assert results["SY1.bytes_over_floor"]["met"] and results["SY2.bytes_over_full"]["met"]
    assert results["SY4.catchup_over_union"]["met"]
    assert os.listdir(tmp_path) == ["sync.json"]  # its scratch data is removed

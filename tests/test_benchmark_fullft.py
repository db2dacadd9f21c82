"""The P13 full fine-tune benchmark (benchmarks/fullft.py) runs end to end on a tiny model and its JSON carries the id,
the goals, a finite ratio and the bit-for-bit load check; the figures themselves are checked by running it at full
size, never by timed tests."""

from __future__ import annotations

import json
import math
import os
import subprocess

from .conftest import PYTHON, ROOT


def test_fullft_runs_and_reports_p13(tmp_path, child_env):
    out = tmp_path / "p13.json"
    proc = subprocess.run([PYTHON, os.path.join(ROOT, "benchmarks", "fullft.py"), "--model-mib", "4",
                           "--workdir", str(tmp_path), "--json", str(out)],
                          env=child_env, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"P13.fullft_logical_over_stored" in proc.stdout
    [r] = json.loads(out.read_text())["results"]
    assert r["id"] == "P13.fullft_logical_over_stored"
    assert r["goal"] == 2.0 and r["goal_op"] == ">=" and r["save_time_goal"] == 1.25
    assert isinstance(r["ratio"], float) and math.isfinite(r["ratio"]) and r["ratio"] > 0
    assert math.isfinite(r["save_time_ratio"]) and r["save_time_ratio"] > 0
    assert r["met"] == (r["ratio"] >= 2.0 and r["save_time_ratio"] <= 1.25)
    assert r["verified"] and all(p["verified"] for p in r["peers"].values())  # the load check ran and matched
    assert r["context"]["precision"] == "bf16" and all(p["verified"] for p in r["context"]["repos"].values())
    assert {"uncompressed", "default", "zstd"} <= set(r["peers"])
    assert len(r["stored_bytes_per_save"]) == r["saves"] == 8
    assert r["logical_bytes"] == 8 * r["model"]["param_bytes"]
    assert abs(r["model"]["param_bytes"] - (4 << 20)) < (64 << 10)  # the model is built to the size asked for
    assert all(0 < f <= 1 for f in r["changed_fraction_per_step"])  # real gradients move the weights every step
    f = r["fp32"]  # the fp32 run (issue 31): an HF model fine-tuned in fp32, luopan against save_pretrained
    assert f["precision"] == "fp32" and f["verified"] and set(f["peers"]) == {"save_pretrained", "uncompressed",
                                                                               "default"}
    assert math.isfinite(f["ratio"]) and f["ratio"] > 0 and len(f["stored_bytes_per_save"]) == 8
    assert f["time_over_save_pretrained"] > 0 and f["time_over_save_pretrained_synced"] > 0
    assert len(f["xor_entries_per_save"]) == 8 and f["save_pretrained_bytes"] > f["model"]["param_bytes"] // 2
    assert os.listdir(tmp_path) == ["p13.json"]  # its scratch data is removed

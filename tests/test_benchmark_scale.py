"""The scale suite's metadata half (benchmarks/scale.py) runs, tiny, and reports every id it owns with a value
computed from what it measured (the full-size figures are in docs/scale.md; SC6-SC8 are tests/test_scale_ranks.py's
protocol, measured by benchmarks/scale_ranks.py)."""

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_scale_metadata_suite_runs_tiny_and_reports_its_ids(tmp_path):
    sys.path.insert(0, BENCH)
    try:
        import scale
    finally:
        sys.path.remove(BENCH)
    results, context = scale.run_metadata(True, str(tmp_path), lambda _m: None, tensors=64, total=14,
                                           marks=[4, 7, 14])
    ids = [r["id"] for r in results]
    assert ids == [scale.ID_GC, scale.ID_LS, scale.ID_SAVE, scale.ID_LOAD, scale.ID_SHARE]
    for r in results:
        assert r["value"] > 0 and r["goal_op"] == "<=" and r["met"] == (r["value"] <= r["goal"]), r
    assert context["marks"][14]["checkpoints"] == 14 and context["pruned"] == 4
    assert context["state"]["chunks"] == 64 * 64  # 64 tensors of 256 KiB in 4 KiB chunks
    share = results[-1]
    assert share["first_manifest_bytes"] > 10 * share["steady_manifest_bytes"]  # what grouping saves, measured

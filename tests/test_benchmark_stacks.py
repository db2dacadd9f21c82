"""The `stacks` suite (benchmarks/stacks.py) gathers one module per stack; a stack that fails is reported with its
ids and its error while the others still run (each stack's module has its own tiny-run test)."""

import os
import sys
import types

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _stacks():
    sys.path.insert(0, BENCH)
    try:
        import stacks
    finally:
        sys.path.remove(BENCH)
    return stacks


def test_stacks_suite_names_the_issue_ids():
    assert _stacks().IDS == ["E1.lightning_bytes_over_default", "E2.sqlite_bytes_over_luopan_two_workers",
                             "E3.write_index_over_luopan_with_deletes"]


def test_a_failing_stack_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    stacks = _stacks()
    good = types.ModuleType("fake_good")
    good.run = lambda quick, workdir, log: [{"id": "X1.good", "value": 2.0, "ratio": 2.0, "goal": 1.0,
                                             "goal_op": ">=", "met": True, "peer": "p", "peer_bytes": 10,
                                             "luopan_bytes": 5}]
    bad = types.ModuleType("fake_bad")

    def boom(quick, workdir, log):
        raise RuntimeError("no such stack")

    bad.run = boom
    monkeypatch.setitem(sys.modules, "fake_good", good)
    monkeypatch.setitem(sys.modules, "fake_bad", bad)
    monkeypatch.setattr(stacks, "AREAS", [("fake_bad", ["X0.bad"]), ("fake_good", ["X1.good"])])
    report = stacks.run_stacks(True, str(tmp_path), lambda _m: None)
    by_id = {r["id"]: r for r in report["results"]}
    assert by_id["X0.bad"]["met"] is None and "no such stack" in by_id["X0.bad"]["error"]
    assert by_id["X1.good"]["met"] is True
    assert any("fake_bad" in p for p in report["problems"])
    stacks.print_report(report)
    out = capsys.readouterr().out
    assert "FAILED" in out and "X1.good" in out
    assert os.listdir(tmp_path) == []  # its scratch directory is removed

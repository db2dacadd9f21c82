"""LuopanSaver against langgraph-checkpoint-conformance: every base capability and every extended one it implements
(delete_for_runs, copy_thread, prune). Each capability is its own pytest test; a failure prints the suite's report
with the failing tests' tracebacks."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest

conformance = pytest.importorskip(
    "langgraph.checkpoint.conformance",
    reason="langgraph-checkpoint-conformance is not installed (pip install langgraph-checkpoint-conformance)")

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    ALL_CAPABILITIES,
    BASE_CAPABILITIES,
    DetectedCapabilities,
)
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from luopan.langgraph import LuopanSaver

CAPS = sorted(c.value for c in ALL_CAPABILITIES)


@checkpointer_test(name="LuopanSaver")
async def luopan_checkpointer():
    work = tempfile.mkdtemp(prefix="luopan-lg-conf-")
    saver = LuopanSaver(work)
    try:
        yield saver
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)


def test_every_capability_is_implemented(tmp_path):
    with LuopanSaver(str(tmp_path)) as saver:
        detected = DetectedCapabilities.from_instance(saver)
    assert not detected.missing, f"not implemented: {sorted(c.value for c in detected.missing)}"
    assert BASE_CAPABILITIES <= detected.detected


@pytest.mark.parametrize("capability", CAPS)
def test_conformance(capability, capsys):
    lines: list[str] = []

    def on_result(cap: str, name: str, passed: bool, error: str | None) -> None:
        lines.append(f"{'PASS' if passed else 'FAIL'} {cap}.{name}" + (f"\n{error}" if error else ""))

    report = asyncio.run(validate(luopan_checkpointer, capabilities={capability},
                                  progress=ProgressCallbacks(on_test_result=on_result)))
    result = report.results[capability]
    print("\n".join(lines))
    report.print_report()
    assert result.detected, f"{capability} not detected"
    assert result.tests_failed == 0 and result.passed is True, "\n".join(result.failures) + "\n" + "\n".join(
        ln for ln in lines if ln.startswith("FAIL"))
    assert result.tests_passed > 0


def test_whole_suite_full_conformance():
    report = asyncio.run(validate(luopan_checkpointer))
    report.print_report()
    assert report.passed_all_base()
    assert report.conformance_level() == "FULL", report.to_dict()

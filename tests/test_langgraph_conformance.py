"""LuopanSaver against langgraph-checkpoint-conformance: every base capability and every extended one it implements
(delete_for_runs, copy_thread, prune). Each capability is its own pytest test; a failure prints the suite's report
with the failing tests' tracebacks."""

from __future__ import annotations

import asyncio
import json
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


# -- the suite while another process writes to the same journal (issue 31) ------------------------------------------
SHARED: dict = {}


async def _second_process():
    """One repository for the whole run, and a second process putting, writing, deleting and compacting on threads
    of its own in it (``tests/langgraph_workers.py noise``) while the suite runs against savers on the same journal."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tempfile.mkdtemp(prefix="luopan-lg-conf2-")
    stop = os.path.join(work, "stop")
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "tests", "langgraph_workers.py"), "noise",
                             os.path.join(work, "repo"), stop], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env, text=True)
    SHARED.update(repo=os.path.join(work, "repo"), proc=proc)
    try:
        with LuopanSaver(SHARED["repo"]) as probe:  # the other process has written before the suite starts
            while not list(probe.list({"configurable": {"thread_id": "noise-0"}}, limit=1)):
                assert proc.poll() is None, proc.communicate()[1][-4000:]
                await asyncio.sleep(0.05)
        yield
    finally:
        open(stop, "w").close()
        out, err = proc.communicate(timeout=120)
        SHARED["result"] = (proc.returncode, out, err)
        if proc.returncode == 0:
            got = json.loads(out.strip().splitlines()[-1])
            with LuopanSaver(SHARED["repo"]) as saver:  # everything the other process left is there
                SHARED["seen"] = {t: len(list(saver.list({"configurable": {"thread_id": t}}))) for t in got["left"]}
            SHARED["left"] = got["left"]
        shutil.rmtree(work, ignore_errors=True)


@checkpointer_test(name="LuopanSaver beside another process", lifespan=_second_process)
async def luopan_shared_checkpointer():
    saver = LuopanSaver(SHARED["repo"])
    try:
        yield saver
    finally:
        saver.close()


def test_whole_suite_with_another_process_writing_to_the_same_journal():
    lines: list[str] = []

    def on_result(cap: str, name: str, passed: bool, error: str | None) -> None:
        if not passed:
            lines.append(f"FAIL {cap}.{name}\n{error}")

    report = asyncio.run(validate(luopan_shared_checkpointer, progress=ProgressCallbacks(on_test_result=on_result)))
    report.print_report()
    print("\n".join(lines))
    code, _out, err = SHARED["result"]
    assert code == 0, err[-4000:]
    assert report.passed_all_base()
    assert report.conformance_level() == "FULL", "\n".join(lines)
    assert sum(SHARED["left"].values()) > 0 and SHARED["seen"] == SHARED["left"]

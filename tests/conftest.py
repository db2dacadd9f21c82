import os
import sys

import pytest

import luopan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def repo_path(tmp_path):
    return tmp_path / "repo"


@pytest.fixture
def repo(repo_path):
    r = luopan.open(repo_path)
    yield r
    r.close()


@pytest.fixture
def child_env():
    """Environment for subprocesses that import luopan from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("LUOPAN_CRASH_AT", None)
    return env


PYTHON = sys.executable


def pytest_terminal_summary(terminalreporter):
    """How many power-loss crash states (tests/powerloss.py) this run checked, and over how many operations."""
    from .powerloss import TOTAL, STATES_PER_OPERATION

    if TOTAL["operations"]:
        terminalreporter.write_line(
            f"power-loss simulator: {TOTAL['states']} crash states checked over {TOTAL['operations']} recorded "
            f"operations (at most {STATES_PER_OPERATION} each; LUOPAN_POWERLOSS_STATES raises it)")

"""The README's journal, LangGraph and vector-index examples run as written (in a fresh directory, in a child
process), and print what the README says they print."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from .conftest import PYTHON, ROOT


def block(lang: str, marker: str) -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (found,) = [b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if marker in b]
    return found


def run_python(code: str, cwd, env) -> str:
    proc = subprocess.run([PYTHON, "-c", code], cwd=cwd, env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc.stdout.decode()


def test_journal_example(tmp_path, child_env):
    out = run_python(block("python", "from luopan.journal import Journal"), tmp_path, child_env)
    lines = out.splitlines()
    assert lines[0].startswith("1 [{'step': 1") and lines[0].endswith("b'raw bytes are records too']")
    assert lines[1] == "2 []"


def test_langgraph_example(tmp_path, child_env):
    pytest.importorskip("langgraph.graph", reason="langgraph is a dev dependency (make setup installs it)")
    out = run_python(block("python", 'LuopanSaver("agent-state")'), tmp_path, child_env)  # the first example
    assert out.strip() == "seen 1 messages"


def test_index_examples(tmp_path, child_env):
    pytest.importorskip("faiss", reason="faiss-cpu is a dev dependency (make setup installs it)")
    out = run_python(block("python", "luopan.index.IndexStore"), tmp_path, child_env)
    assert out.strip() == "1 [1, 2, 3]"  # v3 is the snapshot after remove_ids
    env = {**child_env, "PATH": os.path.dirname(PYTHON) + os.pathsep + child_env.get("PATH", "")}
    script = block("bash", "luopan index ls").replace("luopan ", f"{os.path.join(os.path.dirname(PYTHON), 'luopan')} ")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
    assert "kb-main" in proc.stdout.decode()

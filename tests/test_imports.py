"""The package's shape (docs/format.md §2a, ../shared/DESIGN.md): no import cycle anywhere in src/luopan, the core
imports no kind, no kind imports another, and every module imports on its own in a fresh interpreter."""

from __future__ import annotations

import ast
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import PYTHON, ROOT

SRC = os.path.join(ROOT, "src")
PACKAGE = os.path.join(SRC, "luopan")
KINDS = ("luopan.checkpoint", "luopan.artifact", "luopan.journal", "luopan.index")
CORE = ("luopan.repository", "luopan.store", "luopan.format")


def modules() -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), SRC)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return out


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (functions included), except under TYPE_CHECKING."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "luopan":
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_no_import_cycle_in_the_package():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_core_imports_no_kind_and_kinds_import_no_other_kind():
    g = graph()
    bad = []
    for name, deps in g.items():
        if name.startswith(CORE):
            bad += [f"{name} imports the kind {d}" for d in deps if d.startswith(KINDS)]
        for kind in KINDS:
            if name.startswith(kind):
                bad += [f"{name} imports another kind, {d}" for d in deps
                        if d.startswith(KINDS) and not d.startswith(kind)]
    assert not bad, "\n".join(bad)


def test_every_module_imports_on_its_own():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def one(name: str) -> tuple[str, int, str]:
        proc = subprocess.run([PYTHON, "-c", f"import {name}"], env=env, capture_output=True, timeout=120)
        return name, proc.returncode, proc.stderr.decode()[-1500:]

    names = sorted(n for n in modules() if not n.startswith(("luopan.torch", "luopan.dcp")) or _has_torch())
    with ThreadPoolExecutor(4) as pool:
        failed = [(n, err) for n, rc, err in pool.map(one, names) if rc != 0]
    assert not failed, "\n\n".join(f"{n}:\n{err}" for n, err in failed)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("limit", [450])
def test_no_module_is_far_over_the_size_limit(limit):
    """One concept per module: none over ~400 lines (a margin for docstrings; docs/format.md §2a)."""
    big = {n: sum(1 for _ in open(p, encoding="utf-8")) for n, p in modules().items()}
    assert not {n: c for n, c in big.items() if c > limit}

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


# Imports each module named on the command line in a forked child of an interpreter that has imported only the
# heavy third-party packages (never luopan): each luopan module still imports on its own, with no other luopan
# module loaded, but torch is imported once per batch instead of once per module (~100 s -> ~20 s).
FORKED_IMPORTS = r"""
import importlib, os, sys, traceback
for pre in ("numpy", "torch", "zstandard", "blake3", "xxhash", "typer", "rich.console", "cryptography", "transformers",
            "lightning", "langgraph", "langchain_core", "faiss", "safetensors"):
    try:
        importlib.import_module(pre)
    except ImportError:
        pass
assert not [m for m in sys.modules if m == "luopan" or m.startswith("luopan.")]
failed = 0
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(w, traceback.format_exc()[-1500:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    err = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        err += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if status:
        failed += 1
        print("FAILED " + name + "\n" + err.decode(errors="replace"), flush=True)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own():
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    names = sorted(n for n in modules() if not n.startswith(("luopan.torch", "luopan.dcp")) or _has_torch())

    def batch(part: list[str]) -> tuple[int, str]:
        proc = subprocess.run([PYTHON, "-c", FORKED_IMPORTS, *part], env=env, capture_output=True, timeout=600)
        return proc.returncode, proc.stdout.decode()[-20000:] + proc.stderr.decode()[-3000:]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(batch, [names[0::2], names[1::2]]))
    assert all(rc == 0 for rc, _out in results), "\n\n".join(out for rc, out in results if rc)


def test_the_import_check_catches_a_module_that_cannot_import(tmp_path):
    """The forked check reports a module whose import fails (so the test above can fail)."""
    (tmp_path / "broken_mod.py").write_text("import luopan\nraise ImportError('broken on purpose')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([PYTHON, "-c", FORKED_IMPORTS, "luopan.units", "broken_mod"], env=env,
                          capture_output=True, timeout=300)
    assert proc.returncode == 1
    out = proc.stdout.decode()
    assert "FAILED broken_mod" in out and "broken on purpose" in out and "FAILED luopan.units" not in out


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

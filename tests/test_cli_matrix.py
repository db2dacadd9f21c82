"""The CLI matrix: every command against every kind of broken or odd repository (issue: hardening).

Each row is a repository condition — a missing path, a regular file, an empty directory, a damaged config, a
read-only repository (by permissions and by a read-only mount), unreadable files, ``runs/``, ``packs/`` and
``locks/`` as symbolic links, stray entries (a FIFO, a copied run, a manifest name out of range, a link to a
directory named like a manifest, a note under ``locks/``) — and each column a command. Every cell must end with
the documented exit code, no traceback, at most one ``error:`` line, and within its time limit (a FIFO must never
be opened). Commands run in-process in one driver process per row (tests/cli_driver.py); rows that need permission
checks run the driver without the capabilities that let root ignore file modes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import luopan

from .conftest import ROOT

DRIVER = os.path.join(ROOT, "tests", "cli_driver.py")
RUN = "a"

# Exit codes (luopan --help): 0 ok, 1 error, 2 usage, 3 damaged data, 4 not found, 5 newer format.
COMMANDS: dict[str, list[str]] = {  # in this order: pin/unpin before prune, init last (it creates a repository)
    "ls": ["ls"],
    "ls-run": ["ls", RUN],
    "show": ["show", RUN],
    "show-step": ["show", RUN, "1"],
    "verify": ["verify"],
    "verify-run": ["verify", RUN],
    "du": ["du"],
    "export": ["export", RUN, "--output", "{out}/model.safetensors"],
    "diff": ["diff", RUN, "1", "2"],
    "locks": ["locks"],
    "pin": ["pin", RUN, "1"],
    "unpin": ["unpin", RUN, "2"],
    "prune-dry": ["prune", RUN, "--keep-last", "1", "--dry-run"],
    "prune": ["prune", RUN, "--keep-last", "1"],
    "gc-dry": ["gc", "--dry-run"],
    "gc": ["gc", "--grace", "0"],
    "unlock": ["unlock"],
    "replicate": ["replicate"],
    "cold": ["cold"],
    "init": ["init"],
}

ALL_NOT_FOUND = {**{c: 4 for c in COMMANDS}, "init": 0}
READ_ONLY_WRITES = {"init": 1, "prune": 1, "pin": 1, "unpin": 1, "gc": 1}
GOOD = {**{c: 0 for c in COMMANDS}, "init": 1, "replicate": 1, "cold": 1}

# condition -> expected exit code per command
EXPECTED: dict[str, dict[str, int]] = {
    "good": GOOD,
    "missing": ALL_NOT_FOUND,
    "regular-file": {**{c: 4 for c in COMMANDS}, "init": 1},
    "empty-dir": ALL_NOT_FOUND,
    "damaged-config": {**{c: 3 for c in COMMANDS}, "init": 1},
    "read-only-perms": {**GOOD, **READ_ONLY_WRITES},
    "read-only-mount": {**GOOD, **READ_ONLY_WRITES},
    "unreadable-files": {**GOOD, "ls-run": 3, "show-step": 1, "verify": 3, "verify-run": 3, "export": 1,
                         "diff": 1, "prune-dry": 1, "prune": 1, "gc-dry": 3, "gc": 3},
    "dangling-run-link": {**GOOD, "verify": 3, "gc-dry": 3, "gc": 3},
    "dangling-runs-link": {**GOOD, "ls-run": 4, "show": 4, "show-step": 4, "verify": 3, "verify-run": 3,
                           "export": 4, "diff": 4, "pin": 4, "prune-dry": 4, "prune": 4, "gc-dry": 3,
                           "gc": 3},
    "runs-symlink": GOOD,
    "packs-symlink": GOOD,
    "locks-symlink": GOOD,
    "strays": GOOD,
}


def _make_good(path) -> None:
    with luopan.open(path, chunk_size=4096, pack_size=1 << 16) as repo:
        rng = np.random.default_rng(0)
        for step in (1, 2):
            repo.save(RUN, step, {"w": rng.standard_normal(3000).astype(np.float32), "step": step},
                      metrics={"loss": 1.0 / step})
        repo.run(RUN).pin(2, "release")
        repo.run(RUN).log_eval(2, {"acc": 0.5}, samples=[{"q": "x", "a": "y"}])


def _move_out(repo, name: str, tmp) -> None:
    """Move <repo>/<name> to another directory and link it back (a directory moved to another disk)."""
    target = tmp / f"elsewhere-{name}"
    shutil.move(str(repo / name), str(target))
    os.symlink(target, repo / name)


def _chmod_tree(path, mode_for: callable) -> None:
    for dirpath, dirs, files in os.walk(path):
        for n in files:
            p = os.path.join(dirpath, n)
            os.chmod(p, mode_for(p, False))
        for n in dirs:
            p = os.path.join(dirpath, n)
            os.chmod(p, mode_for(p, True))
    os.chmod(path, mode_for(str(path), True))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "repo"
    _make_good(path)
    return path


def _prepare(condition: str, template, tmp) -> tuple[str, list[str], object]:
    """(repo argument, driver command prefix, cleanup) for a condition."""
    repo = tmp / "repo"
    prefix: list[str] = []
    cleanup = None
    if condition == "missing":
        return str(repo), prefix, None
    if condition == "regular-file":
        repo.write_bytes(b"not a repository\n")
        return str(repo), prefix, None
    if condition == "empty-dir":
        repo.mkdir()
        return str(repo), prefix, None
    shutil.copytree(template, repo, symlinks=True)
    if condition == "damaged-config":
        data = bytearray((repo / "luopan.json").read_bytes())
        data[len(data) // 2] ^= 0x20
        (repo / "luopan.json").write_bytes(bytes(data))
    elif condition in ("read-only-perms", "unreadable-files"):
        prefix = _unprivileged()
        if condition == "read-only-perms":
            _chmod_tree(repo, lambda p, is_dir: 0o555 if is_dir else 0o444)
        else:
            manifest = repo / "runs" / RUN / "ckpt" / "00000001.json"
            with luopan.open(repo, create=False) as r:  # a pack the newest checkpoint needs
                pack = sorted((repo / "packs").rglob(r.manifest(RUN, 2).packs[0] + ".pack"))[0]
            os.chmod(manifest, 0)
            os.chmod(pack, 0)
        cleanup = lambda: _chmod_tree(repo, lambda p, is_dir: 0o755 if is_dir else 0o644)  # noqa: E731
    elif condition == "read-only-mount":
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("a read-only bind mount needs root and mount(8); the permission row covers the rest")
        mnt = tmp / "ro"
        mnt.mkdir()
        if subprocess.run(["mount", "--bind", str(repo), str(mnt)], capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount here (no CAP_SYS_ADMIN); the permission row covers read-only")
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], check=True, capture_output=True)
        cleanup = lambda: subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # noqa: E731
        return str(mnt), prefix, cleanup
    elif condition in ("runs-symlink", "packs-symlink", "locks-symlink"):
        name = condition.split("-")[0]
        if name == "locks":
            (repo / "locks").mkdir(exist_ok=True)
        _move_out(repo, name, tmp)
        if name == "locks":  # files outside the repository that unlock must never touch
            (tmp / "elsewhere-locks" / "notes.json").write_text("{}")
            (tmp / "elsewhere-locks" / "sub").mkdir()
            (tmp / "elsewhere-locks" / "sub" / "x.json").write_text("[]")
    elif condition == "dangling-run-link":  # a run moved to a disk that is not mounted now
        os.symlink(tmp / "unmounted" / "b", repo / "runs" / "b")
    elif condition == "dangling-runs-link":  # all of runs/ moved to a disk that is not mounted now
        shutil.move(str(repo / "runs"), str(tmp / "unmounted-runs"))
        os.symlink(tmp / "unmounted", repo / "runs")
    elif condition == "strays":
        ckpt = repo / "runs" / RUN / "ckpt"
        shutil.copytree(repo / "runs" / RUN, repo / "runs" / "a copy")
        (repo / "runs" / ".git").mkdir()
        (repo / "runs" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (ckpt / "1000000000000000.json").write_text("{}")
        os.mkfifo(ckpt / "00000003.json")
        (tmp / "a-dir").mkdir()
        os.symlink(tmp / "a-dir", ckpt / "00000004.json")
        (repo / "locks" / "notes").mkdir(parents=True, exist_ok=True)
        (repo / "locks" / "notes" / "x.json").write_text("{}")
        os.mkfifo(repo / "packs" / "fifo.pack")
        os.mkfifo(repo / "packs" / "x.pack.tmp-otherhost-1-abcd")  # named like a temporary file: never opened
        os.mkfifo(repo / "index" / ("0" * 64 + ".json"))
    return str(repo), prefix, cleanup


def _unprivileged() -> list[str]:
    """A command prefix under which file modes apply: root without the capabilities that bypass them."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv(1): cannot make file modes apply")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def _run_row(repo: str, prefix: list[str], out_dir, timeout: int = 20) -> dict[str, dict]:
    commands = []
    for name, args in COMMANDS.items():
        commands.append([a.replace("{out}", str(out_dir)) for a in args] + ["-r", repo])
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LUOPAN_REPO", None)
    proc = subprocess.run([*prefix, sys.executable, DRIVER, json.dumps({"commands": commands, "timeout": timeout})],
                          capture_output=True, text=True, env=env, timeout=timeout * len(commands) + 60)
    assert proc.returncode == 0, f"driver failed: {proc.stderr[-3000:]}"
    return dict(zip(COMMANDS, json.loads(proc.stdout)))


@pytest.mark.parametrize("condition", list(EXPECTED))
def test_cli_matrix(condition, template, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    os.chmod(out_dir, 0o777)
    repo, prefix, cleanup = _prepare(condition, template, tmp_path)
    try:
        results = _run_row(repo, prefix, out_dir)
    finally:
        if cleanup is not None:
            cleanup()
    problems = []
    for name, res in results.items():
        where = f"{condition} / luopan {' '.join(COMMANDS[name])}"
        if res["hung"]:
            problems.append(f"{where}: hung")
            continue
        if res["exception"] is not None:
            problems.append(f"{where}: {res['exception']} escaped:\n{res['traceback'][-1500:]}")
            continue
        errors = [ln for ln in res["stderr"].splitlines() if ln.startswith("error:")]
        if len(errors) > 1 or "Traceback" in res["stderr"]:
            problems.append(f"{where}: more than one error line: {res['stderr'][-800:]}")
        expected = EXPECTED[condition][name]
        if res["exit_code"] != expected:
            problems.append(f"{where}: exit {res['exit_code']}, expected {expected}; stderr: "
                            f"{res['stderr'][-600:]!r} stdout: {res['stdout'][-300:]!r}")
    assert not problems, "\n".join(problems)
    if condition == "locks-symlink":  # unlock never deleted a file that is not a lock record
        assert (tmp_path / "elsewhere-locks" / "notes.json").exists()
        assert (tmp_path / "elsewhere-locks" / "sub" / "x.json").exists()
    if condition in ("runs-symlink", "packs-symlink", "strays"):  # gc --grace 0 kept every checkpoint loadable
        with luopan.open(repo, create=False) as r:
            assert r.steps(RUN) == [1, 2]  # prune --keep-last 1 kept the newest and the one pinned
            assert r.verify(RUN).ok
            np.testing.assert_array_equal(r.load(RUN)["step"], 2)

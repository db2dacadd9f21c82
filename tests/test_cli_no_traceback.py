"""No Python traceback reaches a user: EVERY command of the CLI (enumerated from the typer app, subcommands
included, so commands added later are covered without touching this file) run with plausible arguments, plain and
with --json, against a damaged repository (a truncated pack, a garbled manifest), an empty one (just `luopan
init`) and a path where there is none. Each must end with one of the documented exit codes (0-5) and print no
traceback; an exception escaping a command (a bug) fails the test with its traceback."""

from __future__ import annotations

import json
import traceback

import numpy as np
import pytest
import typer.main
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app

RUN = "a"
DOCUMENTED = {0, 1, 2, 3, 4, 5}
# Commands that change or remove what later commands look at run last, in this order.
LAST = ("pin", "unpin", "prune", "artifact prune", "rm", "index rollback", "unlock", "gc", "init")


def commands() -> list[tuple[tuple[str, ...], object]]:
    """(path, click command) of every leaf command of the app, e.g. (("artifact", "ls"), cmd)."""
    found = []

    def walk(cmd: object, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs is None:
            found.append((path, cmd))
            return
        for name, sub in sorted(subs.items()):
            walk(sub, path + (name,))

    walk(typer.main.get_command(app), ())
    order = {name: i for i, name in enumerate(LAST)}
    return sorted(found, key=lambda pc: order.get(" ".join(pc[0]), -1))


def plausible(name: str, path: tuple[str, ...], tmp) -> str:
    """A plausible value for a required argument or option, by its parameter name (anything else gets "x")."""
    artifact = path[:1] == ("artifact",)
    values = {
        "run": RUN, "step": "1", "step_a": "1", "step_b": "2", "first": f"{RUN}@1", "second": f"{RUN}@2",
        "version": "1", "from_step": "1", "to_step": "2",
        "name": "ds/x" if artifact else RUN, "ref": "ds/x@1" if artifact or path == ("lineage",) else f"{RUN}@1",
        "path": str(tmp / "data"), "dest": str(tmp / "checkout"), "output": str(tmp / "out" / "file"),
        "patch": str(tmp / "missing.lpatch"), "base": str(tmp / "missing.safetensors"),
        "url": str(tmp / "channel"), "channel": str(tmp / "channel"), "key": str(tmp / "keys" / "k.key"),
        "sign": str(tmp / "keys" / "k.key"), "params": "7B", "bandwidth": "500MB/s",
    }
    return values.get(name, "x")


def argv(path: tuple[str, ...], cmd, repo: str, tmp, as_json: bool) -> list[str]:
    args = list(path)
    names = {p.name: p for p in cmd.params}
    for p in cmd.params:
        if getattr(p, "param_type_name", "") == "argument" and p.required:
            args.append(plausible(p.name, path, tmp))
    for p in cmd.params:
        if getattr(p, "param_type_name", "") == "option" and p.required:
            args += [p.opts[0], plausible(p.name, path, tmp)]
    if path == ("diff",):  # the cross-run form is covered by first/second; the same-run one too
        args = ["diff", RUN, "1", "2"]
    if "repo" in names:
        args += ["-r", repo]
    if as_json and any("--json" in getattr(p, "opts", ()) for p in cmd.params):
        args.append("--json")
    return args


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    base = tmp_path_factory.mktemp("notraceback")
    path = base / "repo"
    with luopan.open(path, chunk_size=4096, pack_size=1 << 14) as repo:
        rng = np.random.default_rng(0)
        for step in (1, 2):
            repo.save(RUN, step, {"w": rng.standard_normal(3000).astype(np.float32)}, metrics={"loss": 1 / step})
        repo.save("b", 1, {"w": rng.standard_normal(3000).astype(np.float32)}, metrics={"loss": 0.7})
        repo.run(RUN).pin(1, "keep")
        data = base / "data"
        data.mkdir()
        (data / "f.txt").write_text("hello\n" * 100)
        repo.artifact("ds/x").commit(data)
        packs_of_2 = repo.manifest(RUN, 2).packs
    return path, packs_of_2


def _damage(path, packs) -> None:
    """Truncate a pack step 2 of run a needs and garble the manifest of run b."""
    pack = next(p for p in sorted((path / "packs").rglob("*.pack")) if p.stem in packs)
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 2])
    manifest = path / "runs" / "b" / "ckpt" / "00000001.json"
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    manifest.write_bytes(bytes(raw))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for var in ("LUOPAN_REPO", "LUOPAN_TRUSTED_KEYS", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f.txt").write_text("data\n")
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)  # what a command writes by default (luopan report) lands here
    return tmp_path


@pytest.mark.parametrize("condition", ["damaged", "empty", "missing"])
def test_no_command_prints_a_traceback(condition, template, workdir):
    import shutil

    repo = workdir / "repo"
    if condition == "damaged":
        shutil.copytree(template[0], repo)
        _damage(repo, template[1])
    elif condition == "empty":
        luopan.init(repo).close()
    cmds = commands()
    assert len(cmds) >= 30 and any(p == ("stats",) for p, _ in cmds), [p for p, _ in cmds]
    runner = CliRunner()
    failures = []
    for as_json in (False, True):
        for path, cmd in cmds:
            args = argv(path, cmd, str(repo), workdir, as_json)
            res = runner.invoke(app, args)
            text = res.output + (res.stderr if _has_stderr(res) else "")
            exc = res.exception
            if exc is not None and not isinstance(exc, SystemExit):
                failures.append(f"{args}: raised {type(exc).__name__}: {exc}\n"
                                + "".join(traceback.format_exception(exc)))
            elif "Traceback (most recent call last)" in text:
                failures.append(f"{args}: printed a traceback:\n{text[-2000:]}")
            elif res.exit_code not in DOCUMENTED:
                failures.append(f"{args}: exit {res.exit_code}, not a documented code:\n{text[-500:]}")
            elif as_json and res.exit_code == 0 and "--json" in args:
                try:
                    json.loads(res.stdout)
                except ValueError:
                    failures.append(f"{args}: --json printed no JSON document:\n{res.stdout[:500]}")
    assert not failures, "\n\n".join(failures)


def _has_stderr(res) -> bool:
    try:
        return bool(res.stderr) and res.stderr not in res.output
    except ValueError:  # an old click that mixes stderr into output
        return False

"""CLI habits (restic's and git's): ``luopan stats``, ``check``, ``rm``, ``latest``, ``ls --best``, ``diff`` across
runs, ``--json`` on every command, plain output when stdout is not a terminal, one-line errors for system errors."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli import app as app_module
from luopan.cli.main import app
from luopan.format.names import latest_ref_key

LONG = "model.layers.0.self_attn.q_proj.lora_A.default.weight_with_a_name_longer_than_eighty_columns_of_a_terminal"


def cli(*args, code=0, env=None):
    res = CliRunner().invoke(app, [str(a) for a in args], env=env)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res


def as_json(*args, code=0):
    return json.loads(cli(*args, "--json", code=code).stdout)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv("LUOPAN_REPO", raising=False)
    path = tmp_path / "repo"
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(4096).astype(np.float32)
    with luopan.open(path, chunk_size=4096, compression="none") as r:
        for step, loss, acc in ((10, 0.9, 0.5), (20, 0.4, 0.7), (30, 0.6, 0.8)):
            r.save("a", step, {"shared": shared, LONG: np.full(1024, step, np.float32)},
                   metrics={"loss": loss, "acc": acc})
        r.save("b", 5, {"shared": shared, "head": rng.standard_normal(2048).astype(np.float32)},
               metrics={"loss": 0.3})
    return path


# -- stats ---------------------------------------------------------------------------------------------------------

def test_stats_whole_repository_and_one_run(repo):
    d = as_json("stats", "-r", repo)
    assert d["checkpoints"] == 4
    assert d["logical_bytes"] == 3 * (4096 + 1024) * 4 + (4096 + 2048) * 4
    # distinct chunks: shared (4 chunks, once), three versions of LONG, b's head (2 chunks)
    assert d["stored_bytes"] == 4 * 4096 + 3 * 4096 + 2 * 4096 and d["chunks"] == 9
    assert d["dedup_ratio"] == pytest.approx(d["logical_bytes"] / d["stored_bytes"], abs=1e-3)
    runs = {r["run"]: r for r in d["runs"]}
    assert runs["a"]["checkpoints"] == 3 and runs["a"]["latest_step"] == 30
    assert runs["a"]["exclusive_bytes"] == 3 * 4096 and runs["b"]["exclusive_bytes"] == 2 * 4096  # shared by both
    assert d["largest_entries"][0] == {"run": "a", "step": 30, "path": "shared", "dtype": "float32",
                                       "shape": [4096], "nbytes": 16384}
    assert d["repository"]["pack_bytes"] > 0
    one = as_json("stats", "-r", repo, "b")
    assert one["checkpoints"] == 1 and one["stored_bytes"] == 6 * 4096 and [r["run"] for r in one["runs"]] == ["b"]
    text = cli("stats", "-r", repo).stdout
    assert "4 checkpoints" in text and "only this run" in text and LONG in text
    assert "no checkpoints" in cli("stats", "-r", repo, "nope", code=4).output


def test_du_and_stats_agree_on_one_repository(repo):
    with luopan.open(repo, create=False) as r:
        r.save("c", 1, {"gone": np.arange(4096, dtype=np.float32)})
        r.delete("c", 1)  # its chunk stays in a pack until gc: on storage, in no manifest
    du, st = as_json("du", "-r", repo), as_json("stats", "-r", repo)
    for key in ("logical_bytes", "stored_bytes", "chunks", "dedup_ratio"):
        assert du[key] == st[key] == st["repository"][key], key
    assert du["dedup_ratio"] == pytest.approx(du["logical_bytes"] / du["stored_bytes"], abs=1e-3)
    assert du["dedup_ratio"] > 2
    assert du["physical_bytes"] > du["stored_bytes"] + 4096  # metadata and the deleted chunk: not in the ratio
    text = cli("du", "-r", repo).stdout
    assert f"{du['dedup_ratio']:.1f}× dedup" in text
    assert f"{du['dedup_ratio']:.1f}× dedup" in cli("stats", "-r", repo).stdout
    for command in ("du", "stats"):
        shown = " ".join(cli(command, "--help").stdout.split())
        assert "Dedup ratio = logical bytes" in shown and "/ stored bytes" in shown, command


# -- check ---------------------------------------------------------------------------------------------------------

def _pack_of(repo, run, step):
    with luopan.open(repo, create=False) as r:
        pack = r.manifest(run, step).packs[0]
    return next(p for p in (repo / "packs").rglob("*.pack") if p.stem == pack)


def test_check_structure_and_data(repo):
    ok = as_json("check", "-r", repo)
    assert ok["ok"] and ok["manifests"] == 4 and ok["chunks"] == 9 and ok["read_data"] is None
    assert ok["chunks_read"] == 0
    assert "structure only" in cli("check", "-r", repo).stdout
    full = as_json("check", "-r", repo, "--read-data")
    assert full["ok"] and full["chunks_read"] == 9 and full["bytes_read"] == 9 * 4096
    part = as_json("check", "-r", repo, "--read-data-subset", "34%")
    assert part["chunks_read"] == 4  # ceil(9 * 0.34)
    groups = [as_json("check", "-r", repo, "--read-data-subset", f"{n}/3")["chunks_read"] for n in (1, 2, 3)]
    assert sum(groups) == 9  # the groups cover every chunk once
    # a flipped byte inside a chunk: the structure is intact, reading the data finds it
    pack = _pack_of(repo, "b", 5)
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert as_json("check", "-r", repo)["ok"]
    bad = as_json("check", "-r", repo, "--read-data", code=3)
    assert not bad["ok"] and any("hash mismatch" in p["message"] for p in bad["problems"])
    res = cli("check", "-r", repo, "--read-data-subset", "100%", code=3)
    assert "DAMAGED" in res.output and "hash mismatch" in res.output


def test_check_finds_structural_damage(repo):
    pack = _pack_of(repo, "a", 30)
    pack.write_bytes(pack.read_bytes()[:-10])  # truncated: the trailer is gone
    manifest = repo / "runs" / "b" / "ckpt" / "00000005.json"
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    manifest.write_bytes(bytes(raw))
    bad = as_json("check", "-r", repo, code=3)
    messages = " | ".join(p["message"] for p in bad["problems"])
    assert pack.stem[:16] in messages and "00000005.json" in messages, messages
    res = cli("check", "-r", repo, code=3)
    assert res.output.count("DAMAGED") == len(bad["problems"]) and "problem(s) found" in res.output


def test_check_finds_missing_pack_dangling_pin_and_ref(repo):
    with luopan.open(repo, create=False) as r:
        r.run("a").pin(10)
    for step in (10, 30):  # removed behind luopan's back: the pin and the latest ref now name nothing
        (repo / "runs" / "a" / "ckpt" / f"{step:08d}.json").unlink()
    _pack_of(repo, "b", 5).unlink()
    bad = as_json("check", "-r", repo, code=3)
    messages = [p["message"] for p in bad["problems"]]
    assert any(p["type"] == "MissingPackError" for p in bad["problems"]), messages
    assert any("protects run 'a' step 10, which is not committed" in m for m in messages), messages
    # a stale latest ref is not damage (docs/format.md §9: readers ignore it, the next save repairs it): a note
    assert not any("names step 30" in m for m in messages), messages
    assert any("names step 30 of run 'a', which is not committed: a stale ref" in n for n in bad["notes"])


def test_check_calls_a_stale_ref_a_note_not_damage(repo):
    with luopan.open(repo, create=False) as r:
        r.save("a", 25, {"w": np.zeros(3)})  # committed last: the ref names 25, below the newest (30)
        r.prune("a", luopan.retention.KeepLast(1))  # keeps 30, removes 25: the ref is stale, as §9 allows
        assert r.steps("a") == [30]
    good = as_json("check", "-r", repo, code=0)
    assert good["ok"] is True and good["problems"] == [] and len(good["notes"]) == 1
    res = cli("check", "-r", repo, code=0)
    assert "note: ref" in res.output and "stale ref" in res.output and "DAMAGED" not in res.output


def test_check_usage_errors(repo):
    assert "not both" in cli("check", "-r", repo, "--read-data", "--read-data-subset", "5%", code=2).output
    for bad in ("0%", "150%", "3/2", "x", "0/4"):
        assert "--read-data-subset takes" in cli("check", "-r", repo, "--read-data-subset", bad, code=2).output


# -- rm ------------------------------------------------------------------------------------------------------------

def _ref_step(repo, run):
    return json.loads((repo / latest_ref_key(run)).read_bytes().split(b"\n")[0])["step"]


def test_rm_one_checkpoint_moves_the_latest_ref(repo):
    assert _ref_step(repo, "a") == 30
    d = as_json("rm", "-r", repo, "a", "--step", "30")
    assert d == {"run": "a", "steps": [30], "whole_run": False, "dry_run": False, "pinned": [],
                 "remaining": [10, 20], "files": 0}
    assert cli("latest", "-r", repo, "a").stdout.strip() == "20" and _ref_step(repo, "a") == 20
    assert as_json("check", "-r", repo)["ok"]
    out = cli("rm", "-r", repo, "a", "--step", "10").stdout
    assert "removed a step 10" in out and "luopan gc" in out
    assert cli("rm", "-r", repo, "a", "--step", "10", code=4).output.count("error:") == 1


def test_rm_whole_run_then_gc_frees_its_data(repo):
    before = as_json("stats", "-r", repo)["repository"]["pack_bytes"]
    dry = as_json("rm", "-r", repo, "a", "--dry-run")
    assert dry["dry_run"] and dry["steps"] == [10, 20, 30] and dry["whole_run"]
    assert "dry run: nothing removed" in cli("rm", "-r", repo, "a", "--dry-run").stdout
    assert cli("latest", "-r", repo, "a").stdout.strip() == "30"
    res = cli("rm", "-r", repo, "a")
    assert "removed run a (3 checkpoint(s): steps 10, 20, 30)" in res.stdout and "luopan gc" in res.stdout
    assert [r["run"] for r in as_json("ls", "-r", repo)["runs"]] == ["b"]
    assert not (repo / latest_ref_key("a")).exists() and not (repo / "runs" / "a" / "record.json").exists()
    assert as_json("check", "-r", repo, "--read-data")["ok"]
    cli("gc", "-r", repo, "--grace", "0")
    cli("gc", "-r", repo, "--grace", "0")
    after = as_json("stats", "-r", repo)["repository"]["pack_bytes"]
    assert after < before
    assert as_json("check", "-r", repo, "--read-data")["ok"]
    cli("rm", "-r", repo, "a", code=4)


def test_rm_refuses_pinned_unless_forced(repo):
    cli("pin", "-r", repo, "a", "20", "--tag", "release")
    res = cli("rm", "-r", repo, "a", code=1)
    assert "step 20 ('release') is pinned" in res.output and "--force" in res.output
    assert res.output.count("\n") == 1  # one line, whatever the terminal width
    cli("rm", "-r", repo, "a", "--step", "20", code=1)
    assert len(as_json("ls", "-r", repo, "a")["checkpoints"]) == 3  # nothing removed
    cli("rm", "-r", repo, "a", "--step", "10")  # not pinned: fine
    d = as_json("rm", "-r", repo, "a", "--force")
    assert d["pinned"] == [20] and d["steps"] == [20, 30]
    assert not (repo / "refs" / "pins" / "a").exists() or not any((repo / "refs" / "pins" / "a").iterdir())
    assert as_json("check", "-r", repo)["ok"]


# -- ls --best, latest, diff across runs ----------------------------------------------------------------------------

def test_ls_best_and_latest(repo):
    assert cli("ls", "-r", repo, "a", "--best", "loss").stdout.split()[0] == "20"
    assert cli("ls", "-r", repo, "a", "--best", "loss:max").stdout.split()[0] == "10"
    assert cli("ls", "-r", repo, "a", "--best", "acc:max").stdout.split()[0] == "30"
    d = as_json("ls", "-r", repo, "a", "--best", "loss")
    assert d["step"] == 20 and d["value"] == 0.4 and d["order"] == "min" and d["candidates"] == 3
    res = cli("ls", "-r", repo, "a", "--best", "Loss", code=2)
    assert "recorded: acc, loss" in res.output
    cli("ls", "-r", repo, "a", "--best", "loss:median", code=2)
    with luopan.open(repo, create=False) as r:  # a metric name with a colon: the order suffix is the last part
        for step, v in ((1, 0.5), (2, 0.25), (3, 0.75)):
            r.save("c", step, {"w": np.zeros(2)}, metrics={"eval:loss": v})
    assert cli("ls", "-r", repo, "c", "--best", "eval:loss").stdout.split()[0] == "2"
    assert cli("ls", "-r", repo, "c", "--best", "eval:loss:max").stdout.split()[0] == "3"
    cli("ls", "-r", repo, "--best", "loss", code=2)
    cli("ls", "-r", repo, "nope", "--best", "loss", code=4)
    assert cli("latest", "-r", repo, "a").stdout == "30\n"
    assert as_json("latest", "-r", repo, "b") == {"run": "b", "step": 5, "checkpoints": 1}
    assert "no committed checkpoint" in cli("latest", "-r", repo, "nope", code=4).output


def test_diff_across_runs_and_within_one(repo):
    d = as_json("diff", "-r", repo, "a@10", "b@5")
    assert d["from_run"] == "a" and d["run"] == "b" and d["from_step"] == 10 and d["to_step"] == 5
    assert [x["path"] for x in d["added"]] == ["head"] and [x["path"] for x in d["removed"]] == [LONG]
    assert d["unchanged"] == 1  # "shared" has the same chunks in both runs
    same = as_json("diff", "-r", repo, "a", "10", "20")
    assert same["from_run"] == same["run"] == "a" and [c["path"] for c in same["changed"]] == [LONG]
    assert "a@10 -> b@5" in cli("diff", "-r", repo, "a@10", "b@5").stdout
    cli("diff", "-r", repo, "a@10", "20", code=2)
    cli("diff", "-r", repo, "a", "10", code=2)
    cli("diff", "-r", repo, "a", "10", "x", code=2)
    cli("diff", "-r", repo, "a@10", "b@6", code=4)


# -- --json everywhere ----------------------------------------------------------------------------------------------

def test_json_on_commands_that_lacked_it(repo, tmp_path):
    new = as_json("init", "-r", tmp_path / "new")
    assert new["format_version"] >= 1 and new["compression"] and new["chunk_size"] > 0
    assert as_json("pin", "-r", repo, "a", "10", "--tag", "t") == {"run": "a", "step": 10, "tag": "t",
                                                                      "pinned": True}
    assert as_json("unpin", "-r", repo, "a", "10") == {"run": "a", "step": 10, "pinned": False}
    assert as_json("unlock", "-r", repo) == {"removed": []}
    v = as_json("verify", "-r", repo)
    assert v["ok"] and v["checkpoints"] == 4 and v["problems"] == []
    out = tmp_path / "m.safetensors"
    e = as_json("export", "-r", repo, "a", "20", "-o", out)
    assert e["step"] == 20 and e["tensors"] == 2 and os.path.exists(e["path"]) and e["signature"] is None
    data = tmp_path / "data"
    data.mkdir()
    (data / "f.txt").write_text("hello\n")
    cli("artifact", "commit", "-r", repo, "ds/x", data)
    assert as_json("artifact", "pin", "-r", repo, "ds/x@1")["pinned"] is True
    assert as_json("artifact", "unpin", "-r", repo, "ds/x@1")["pinned"] is False
    assert as_json("artifact", "verify", "-r", repo, "ds/x@1")["ok"] is True
    assert as_json("verify", "-r", repo, "ds/x@1")["ok"] is True
    c = as_json("artifact", "checkout", "-r", repo, "ds/x@1", tmp_path / "co")
    assert c["version"] == 1 and (tmp_path / "co" / "f.txt").read_text() == "hello\n"
    k = as_json("key", "gen", "-o", tmp_path / "keys")
    assert k["type"] == "ed25519" and k["key_id"]
    s = as_json("sign", "-r", repo, "a", "-k", k["private"])
    assert s["step"] == 30 and s["key_id"] == k["key_id"]
    # damage: verify --json names it and exits 3
    pack = _pack_of(repo, "b", 5)
    raw = bytearray(pack.read_bytes())
    raw[100] ^= 1
    pack.write_bytes(bytes(raw))
    bad = as_json("verify", "-r", repo, code=3)
    assert not bad["ok"] and any("hash mismatch" in p["message"] for p in bad["problems"])


# -- output that is not a terminal, errors -------------------------------------------------------------------------

def test_piped_output_is_plain_and_unwrapped(repo, tmp_path, child_env):
    proc = subprocess.run([sys.executable, "-m", "luopan.cli.main", "show", "-r", str(repo), "a", "30"],
                          capture_output=True, text=True, env=child_env)
    assert proc.returncode == 0, proc.stderr
    assert any(LONG in line for line in proc.stdout.splitlines())  # the whole name on one line
    assert "\x1b[" not in proc.stdout and not set("┏━┃│─╇┡└┘") & set(proc.stdout)
    cmd = [sys.executable, "-m", "luopan.cli.main", "rm", "-r", str(repo), "nope-" + "x" * 90]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env)
    assert proc.returncode == 4 and proc.stderr.count("\n") == 1 and "\x1b[" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "luopan.cli.main", "ls", "--bogus"], capture_output=True,
                          text=True, env=child_env)
    assert proc.returncode == 2 and "No such option" in proc.stderr and "╭" not in proc.stderr


def test_consoles_on_a_terminal_respect_no_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            return len(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert app_module._console().no_color
    monkeypatch.delenv("NO_COLOR")
    assert not app_module._console().no_color
    monkeypatch.setattr(sys, "stdout", open(os.devnull, "w"))
    piped = app_module._console()
    assert piped.no_color and piped.width > 10_000 and not piped.is_terminal


def test_system_errors_are_one_line_with_the_path():
    msg = app_module.error_message
    assert msg(PermissionError(errno.EACCES, "Permission denied", "/data/x")) == "permission denied: /data/x"
    assert msg(OSError(errno.ENOSPC, "No space left on device", "/data/x")) == "disk full: /data/x"
    assert msg(OSError(errno.ENOSPC, "No space left on device")) == "disk full"
    assert msg(FileNotFoundError(errno.ENOENT, "No such file", "/nope")) == "no such file or directory: /nope"
    assert msg(luopan.OutputPathError(errno.ENOENT, "cannot write /x/y: the directory /x does not exist")) == \
        "cannot write /x/y: the directory /x does not exist"

    @app_module.handles_errors
    def fails(exc):
        raise exc

    import typer

    for exc, code in ((PermissionError(errno.EACCES, "Permission denied", "/p"), 1),
                      (OSError(errno.ENOSPC, "No space left on device", "/p"), 1),
                      (luopan.CheckpointNotFoundError("gone"), 4), (luopan.UsageError("bad"), 2)):
        with pytest.raises(typer.Exit) as info:
            fails(exc)
        assert info.value.exit_code == code


def test_export_to_a_missing_directory_or_a_directory(repo, tmp_path):
    res = cli("export", "-r", repo, "a", "-o", tmp_path / "missing-dir" / "x.safetensors", code=1)
    assert "missing-dir" in res.output and "Traceback" not in res.output and res.output.count("error:") == 1
    res = cli("export", "-r", repo, "a", "-o", tmp_path, code=1)
    assert "is a directory" in res.output and "Traceback" not in res.output


def test_shell_completion_is_offered():
    res = cli("--help")
    assert "--install-completion" in res.output and "--show-completion" in res.output

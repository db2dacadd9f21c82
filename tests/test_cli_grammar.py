"""One CLI grammar (issue 28): every flag name means one thing across commands; every command that names a
checkpoint or a version takes RUN@STEP (NAME@V); the old spellings still work for one release with a one-line
``deprecated:`` note on stderr; a malformed reference exits 2. The commands are found by walking the typer app."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.main import get_command
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app


def _walk(cmd, path=()):
    if hasattr(cmd, "commands"):  # a group (the app, artifact, key, patch, index)
        for name, sub in sorted(cmd.commands.items()):
            yield from _walk(sub, path + (name,))
    else:
        yield " ".join(path), cmd


COMMANDS = dict(_walk(get_command(app)))

# -- (a) one meaning per flag -----------------------------------------------------------------------------------------
# flag -> (what it means, its metavar). Every visible flag of every command must be here, and every command's flag
# of that name must show this metavar and have one value type (checked below).
MEANINGS = {
    "--adapter": ("the checkpoint is a PEFT adapter", None), "--all": ("every lock, not only stale ones", None),
    "--allow-unsigned": ("accept an unsigned patch", None), "--bandwidth": ("write bandwidth", "RATE"),
    "--base": ("the device's safetensors file", None),
    "--bytes-only": ("which chunks differ, no tensor read", None), "--best": ("the best checkpoint by a metric",
                                                                   "METRIC[:min|max]"),
    "--channel-dir": ("an update channel's directory", "DIR"), "--channel-name": ("an update channel's name", "NAME"),
    "--chunk-size": ("chunk size in bytes", None), "--compression": ("blob compression", None),
    "--dry-run": ("change nothing, print the plan", None), "--expect-target": ("a target fingerprint", "FP"),
    "--expires": ("how long an index stays valid", None), "--force": ("override a safety refusal: pinned checkpoints, local edits in a checkout", None),
    "--from": ("the base step of a patch", "STEP"), "--from-file": ("a safetensors base file", None),
    "--full": ("read every chunk", None), "--pieces": ("sharded tensors as their stored shards", None),
    "--structure": ("check manifests and packs, read no chunk", None), "--grace": ("gc grace period", "DURATION"),
    "--interval": ("a save interval", "DURATION"), "--into": ("the checkpoint a patch is committed as", "RUN[@STEP]"),
    "--json": ("machine-readable output", None), "--keep": ("published versions to patch from", None),
    "--keep-best": ("retention: N best", "N:METRIC[:min|max]"), "--keep-every": ("retention: one per period",
                                                                                 "DURATION"),
    "--keep-every-steps": ("retention: one per N steps", "N"), "--keep-last": ("retention: N newest", "N"),
    "--keep-local": ("newest N kept locally", "N"), "--keep-tag": ("retention: pinned with a tag", "TAG"),
    "--key": ("an Ed25519 private key file", None), "--kind": ("what NAME is", "run|artifact"),
    "--lora-fraction": ("trainable fraction", "FRACTION"), "--master-weights": ("fp32 master copy", None),
    "--max-output": ("largest output file", "SIZE"), "--meta": ("metadata", "K=V"),
    "--min-version": ("lowest index version", None), "--model-signing-key": ("an EC key for model_signing", "KEY"),
    "--mtbf": ("mean time between failures", "DURATION"), "--name": ("a key pair's file name", None),
    "--older-than": ("an age threshold", None), "--optimizer": ("optimizer state", None),
    "--output": ("the path to write", None), "--pack-size": ("pack size in bytes", None),
    "--params": ("model size", "N"), "--parent": ("an artifact version made from", "NAME@V"),
    "--port": ("a TCP port", None), "--probe": ("a directory to measure", "DIR"), "--probe-size": ("bytes probed",
                                                                                                   "SIZE"),
    "--read-data": ("read every chunk", None), "--read-data-subset": ("read part of the chunks", "PCT|N/M"),
    "--repack-below": ("repack threshold", "FRACTION"), "--repo": ("the repository", None),
    "--require-signature": ("refuse an unsigned patch", None), "--retries": ("download retries", None),
    "--serve": ("serve instead of writing", None), "--sign": ("an Ed25519 private key file that signs", None),
    "--state": ("a device state file", None), "--subtree": ("a key path of tensors", None),
    "--tag": ("a pin's name", None), "--timeout": ("seconds to wait", None),
    "--to": ("a remote store URL or path", None), "--top": ("how many entries", None),
    "--trusted-keys": ("a directory of trusted public keys", None), "--type": ("a key type", None),
    "--weights": ("weight dtype", None),
}
# (command, old hidden flag) -> the visible flag (or RUN@STEP) that replaces it for one release
DEPRECATED_FLAGS = {
    ("export", "--sign"): "--model-signing-key", ("publish", "--channel"): "--channel-dir",
    ("publish", "--name"): "--channel-name", ("pull", "--channel"): "--channel-name",
    ("patch create", "--to"): "RUN@STEP", ("patch apply", "--run"): "--into", ("patch apply", "--step"): "--into",
    ("rm", "--step"): "RUN@STEP",
}


def _options():
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if p.param_type_name == "option":
                for flag in p.opts + p.secondary_opts:
                    yield name, flag, p


def test_every_flag_has_one_meaning():
    seen: dict[str, set] = {}
    shorts: dict[str, set] = {}
    for name, flag, p in _options():
        if p.hidden:
            assert (name, flag) in DEPRECATED_FLAGS, f"hidden {flag} of `{name}` is not a listed deprecated alias"
            continue
        if not flag.startswith("--"):
            shorts.setdefault(flag, set()).add(p.opts[0])
            continue
        assert flag in MEANINGS, f"`{name} {flag}` is a new flag: add its one meaning to MEANINGS"
        if flag not in p.secondary_opts:  # --allow-unsigned is the off side of --require-signature
            assert p.metavar == MEANINGS[flag][1], (name, flag, p.metavar)
        seen.setdefault(flag, set()).add((repr(p.type_descriptor.annotation), p.is_flag))
    mixed = {flag: kinds for flag, kinds in seen.items() if len(kinds) > 1}
    assert not mixed, f"flags with more than one value type across commands: {mixed}"
    assert {s: longs for s, longs in shorts.items() if len(longs) > 1} == {}, "a short flag with two long names"
    assert set(MEANINGS) == set(seen), f"MEANINGS lists flags no command has: {set(MEANINGS) - set(seen)}"


def test_every_deprecated_flag_exists_with_its_replacement():
    hidden = {(name, flag) for name, flag, p in _options() if p.hidden}
    assert hidden == set(DEPRECATED_FLAGS)
    for (name, _old), new in DEPRECATED_FLAGS.items():
        flags = {f for n, f, p in _options() if n == name and not p.hidden}
        refs = [p.metavar for p in COMMANDS[name].params if p.param_type_name == "argument"]
        assert new in flags or (new == "RUN@STEP" and "RUN[@STEP]" in refs), (name, new)


# -- a small repository ------------------------------------------------------------------------------------------------
@pytest.fixture
def ws(tmp_path, monkeypatch):
    monkeypatch.delenv("LUOPAN_REPO", raising=False)
    monkeypatch.delenv("LUOPAN_TRUSTED_KEYS", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f.txt").write_text("x")
    rng = np.random.default_rng(0)
    w = rng.standard_normal(256).astype(np.float32)
    with luopan.open(tmp_path / "repo") as r:
        r.save("run-a", 1, {"w": w})
        r.save("run-a", 2, {"w": w + 1})
        r.save("run-b", 1, {"w": w})
        r.artifact("ds").commit(str(tmp_path / "data"))
    _ok(["key", "gen", "-o", str(tmp_path / "keys")])
    _ok(["export", "-r", str(tmp_path / "repo"), "run-a@1", "-o", str(tmp_path / "base.safetensors")])
    _ok(["patch", "create", "-r", str(tmp_path / "repo"), "run-a@2", "--from", "1", "-o",
         str(tmp_path / "p.lpatch")])
    luopan.open(tmp_path / "device").close()
    return tmp_path


def _run(argv):
    return CliRunner().invoke(app, [str(a) for a in argv], catch_exceptions=False)


def _ok(argv):
    res = _run(argv)
    assert res.exit_code == 0, (argv, res.output)
    return res


def _argv(ws, template):
    return [a.format(ws=ws, key=ws / "keys" / "luopan.key") for a in template] + (
        [] if template[0] in ("key", "pull") else ["-r", str(ws / ("device" if "apply" in template else "repo"))])


# -- (b) every command that names a checkpoint or version takes RUN@STEP / NAME@V ---------------------------------------
REF = {  # command -> argv with the reference; the `ref` position is where a malformed one goes for (d)
    "show": ["show", "{ref}"], "export": ["export", "{ref}", "-o", "{ws}/x.safetensors"], "verify": ["verify", "{ref}"],
    "sign": ["sign", "{ref}", "--key", "{key}"], "pin": ["pin", "{ref}"], "unpin": ["unpin", "{ref}"],
    "diff": ["diff", "run-a@1", "{ref}"], "rm": ["rm", "{ref}"],
    "patch create": ["patch", "create", "{ref}", "--from", "1", "-o", "{ws}/q.lpatch"],
    "publish": ["publish", "{ref}", "--channel-dir", "{ws}/chan", "--sign", "{key}"],
    "lineage link": ["lineage", "link", "{ref}", "ds@1"],
}
GOOD = {"show": "run-a@1", "export": "run-a@2", "verify": "run-a@1", "sign": "run-a@1", "pin": "run-a@1",
        "unpin": "run-a@1", "diff": "run-a@2", "rm": "run-b@1", "patch create": "run-a@2", "publish": "run-a@2",
        "lineage link": "run-a@1"}
VERSION_REF = {  # NAME@V
    "lineage show": ["lineage", "ds@1"], "artifact ls": ["artifact", "ls", "ds@1"],
    "artifact checkout": ["artifact", "checkout", "ds@1", "{ws}/out"], "artifact verify": ["artifact", "verify", "ds@1"],
    "artifact pin": ["artifact", "pin", "ds@1"], "artifact unpin": ["artifact", "unpin", "ds@1"],
    "artifact status": ["artifact", "status", "ds@1", "{ws}/data"], "artifact diff": ["artifact", "diff", "ds@1", "ds@1"],
}


def test_the_reference_commands_are_every_command_with_a_reference():
    takes_ref = {name for name, cmd in COMMANDS.items()
                 if any(p.param_type_name == "argument" and "@" in (p.metavar or "") for p in cmd.params)}
    assert takes_ref == set(REF) | set(VERSION_REF) | {"index rollback"}


@pytest.mark.parametrize("name", sorted(REF) + sorted(VERSION_REF))
def test_run_at_step_works(ws, name):
    if name == "unpin":
        _ok(_argv(ws, ["pin", "run-a@1"]))
    if name == "artifact unpin":
        _ok(_argv(ws, ["artifact", "pin", "ds@1"]))
    template = [a.replace("{ref}", GOOD[name]) for a in REF[name]] if name in REF else VERSION_REF[name]
    res = _ok(_argv(ws, template))
    assert "deprecated" not in res.output


def test_the_step_of_a_reference_is_the_one_used(ws):
    """RUN@STEP names that step, not the latest: what each command did is checked in the repository."""
    assert json.loads(_ok(_argv(ws, ["show", "run-a@1", "--json"])).stdout)["step"] == 1
    assert json.loads(_ok(_argv(ws, ["export", "run-a@1", "-o", "{ws}/one.safetensors", "--json"])).stdout)["step"] == 1
    _ok(_argv(ws, ["pin", "run-a@1"]))
    _ok(_argv(ws, ["sign", "run-a@1", "--key", "{key}"]))
    with luopan.open(ws / "repo") as r:
        assert set(r.run("run-a").pins()) == {1}
        signed = {k.split("/")[-2] for k in r.store.list("refs/signatures/run-a/")}
        assert signed == {"00000001"}, signed
    _ok(_argv(ws, ["rm", "run-a@2", "--force"]))
    with luopan.open(ws / "repo") as r:
        assert r.steps("run-a") == [1]


def test_run_alone_is_the_latest_step(ws):
    assert json.loads(_ok(_argv(ws, ["show", "run-a", "--json"])).stdout)["step"] == 2
    assert json.loads(_ok(_argv(ws, ["export", "run-a", "-o", "{ws}/y.safetensors", "--json"])).stdout)["step"] == 2


def test_patch_apply_into(ws):
    res = _ok(_argv(ws, ["patch", "apply", "{ws}/p.lpatch", "--base", "{ws}/base.safetensors", "--into", "dev@3"]))
    assert "dev step 3" in res.output


def test_index_rollback_takes_name_at_version(ws):
    pytest.importorskip("faiss", reason="index snapshots need faiss (luopan[index])")

    res = _run(_argv(ws, ["index", "rollback", "kb@1"]))
    assert res.exit_code == 4 and "deprecated" not in res.output  # well formed, no such index: not found


# -- (c) the old spellings work for one release and say the new one ----------------------------------------------------
OLD = [
    (["show", "run-a", "1"], "luopan show run-a@1"),
    (["export", "run-a", "1", "-o", "{ws}/z.safetensors"], "luopan export run-a@1"),
    (["verify", "run-a", "1"], "luopan verify run-a@1"),
    (["sign", "run-a", "1", "--key", "{key}"], "luopan sign run-a@1"),
    (["pin", "run-a", "1"], "luopan pin run-a@1"),
    (["diff", "run-a", "1", "2"], "luopan diff run-a@1 run-a@2"),
    (["rm", "run-b", "--step", "1"], "luopan rm run-b@1"),
    (["patch", "create", "run-a", "--from", "1", "--to", "2", "-o", "{ws}/o.lpatch"], "luopan patch create run-a@2"),
    (["publish", "run-a", "2", "--channel", "{ws}/c2", "--name", "beta", "--sign", "{key}"], "--channel-dir"),
    (["patch", "apply", "{ws}/p.lpatch", "--base", "{ws}/base.safetensors", "--run", "dev", "--step", "4"],
     "--into dev@4"),
]


@pytest.mark.parametrize("argv,new", OLD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_old_spellings_still_work_with_a_note(ws, argv, new):
    res = _run(_argv(ws, argv))
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if line.startswith("deprecated:")]
    assert any(new in note for note in notes), res.stderr
    assert all(len(note) < 200 for note in notes)  # one short line each


def test_renamed_flags_say_their_new_name(ws):
    res = _run(_argv(ws, ["publish", "run-a", "--channel", "{ws}/c3", "--name", "beta", "--sign", "{key}"]))
    assert res.exit_code == 0 and "--channel-dir" in res.stderr and "--channel-name" in res.stderr
    res = _run(["pull", str(ws / "c3"), "-o", str(ws / "d.safetensors"), "--trusted-keys", str(ws / "keys"),
                "--channel", "gamma"])
    assert "deprecated: --channel: use --channel-name" in res.stderr and "'gamma'" in res.output
    res = _run(_argv(ws, ["export", "run-a", "-o", "{ws}/e.safetensors", "--sign", "{key}"]))
    assert "deprecated: --sign: use --model-signing-key" in res.stderr  # (then refused: not an EC key)


def test_old_and_new_spelling_together_is_a_usage_error(ws):
    for argv in (["show", "run-a@1", "2"], ["rm", "run-b@1", "--step", "1"],
                 ["publish", "run-a", "--channel", "{ws}/c", "--channel-dir", "{ws}/c", "--sign", "{key}"]):
        res = _run(_argv(ws, argv))
        assert res.exit_code == 2 and "error:" in res.output, (argv, res.output)


def test_json_output_has_no_note(ws):
    res = _ok(_argv(ws, ["show", "run-a", "1", "--json"]))
    assert "deprecated" not in res.output and json.loads(res.output)["step"] == 1


# -- (d) a malformed reference exits 2 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REF))
@pytest.mark.parametrize("bad", ["run-a@x", "run-a@", "run-a@1@2", "run-a@-1"])
def test_a_malformed_reference_exits_2(ws, name, bad):
    res = _run(_argv(ws, [a.replace("{ref}", bad) for a in REF[name]]))
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "Traceback" not in res.output

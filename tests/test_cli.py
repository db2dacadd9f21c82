"""The luopan CLI on a real repository: init, ls, show, verify (incl. damage), du, --json, errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import luopan
import luopan.format
from luopan.cli.main import app

runner = CliRunner()


def cli(*args, env=None):
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "repo"
    repo = luopan.open(path, chunk_size=64 * 1024)
    w = torch.randn(512, 128)
    repo.save("run-a", 100, {"w": w, "tied": w, "b": np.zeros(10)}, metrics={"loss": 0.5})
    w[0] += 1
    repo.save("run-a", 200, {"w": w, "tied": w, "b": np.zeros(10)}, metrics={"loss": 0.25})
    repo.save("run-b", 1, {"x": torch.ones(3)})
    return path


def test_init_then_init_again_fails(tmp_path):
    r = cli("init", "-r", str(tmp_path / "new"), "--compression", "zstd:5")
    assert r.exit_code == 0 and "created luopan repository" in r.output
    assert luopan.open(tmp_path / "new").config.compression.level == 5
    r = cli("init", "-r", str(tmp_path / "new"))
    assert r.exit_code == 1 and "already exists" in r.output


def test_ls_runs_and_checkpoints(filled):
    r = cli("ls", "-r", str(filled))
    assert r.exit_code == 0 and "run-a" in r.output and "run-b" in r.output
    r = cli("ls", "-r", str(filled), "run-a", "--json")
    data = json.loads(r.output)
    cps = data["checkpoints"]
    assert [c["step"] for c in cps] == [100, 200]
    assert cps[0]["metrics"] == {"loss": 0.5}
    assert cps[1]["new_bytes"] == 64 * 1024  # one changed row -> one chunk
    assert cps[1]["dedup_ratio"] > 3
    assert cps[0]["logical_bytes"] == 512 * 128 * 4 + 80


def test_repo_from_environment(filled):
    r = cli("ls", "--json", env={"LUOPAN_REPO": str(filled)})
    assert [x["run"] for x in json.loads(r.output)["runs"]] == ["run-a", "run-b"]


def test_show(filled):
    r = cli("show", "-r", str(filled), "run-a", "100")
    assert r.exit_code == 0 and "loss=0.5" in r.output and "= w" in r.output
    d = json.loads(cli("show", "-r", str(filled), "run-a", "--json").output)
    assert d["step"] == 200
    assert {e["path"]: e.get("alias_of") for e in d["entries"]}["tied"] == "w"
    r = cli("show", "-r", str(filled), "run-a", "150")
    assert r.exit_code == 4 and "committed steps: 100, 200" in r.output


def test_du(filled):
    d = json.loads(cli("du", "-r", str(filled), "--json").output)
    assert d["checkpoints"] == 3
    assert d["logical_bytes"] > d["pack_bytes"] > 0
    assert d["physical_bytes"] == d["pack_bytes"] + d["index_bytes"] + d["manifest_bytes"] + d["ref_bytes"]


def test_verify_ok_and_damaged(filled):
    r = cli("verify", "-r", str(filled))
    assert r.exit_code == 0 and "3 checkpoint(s)" in r.output
    # damage one byte in the middle of the pack that only run-b uses
    repo = luopan.open(filled)
    m = repo.manifest("run-b", 1)
    h, p, off, length, size, codec, _x = m.entries[0]["chunks"][0]
    pack = filled / "packs" / m.packs[p][:2] / f"{m.packs[p]}.pack"
    data = bytearray(pack.read_bytes())
    data[off + 1] ^= 0xFF
    pack.write_bytes(bytes(data))
    r = cli("verify", "-r", str(filled))
    assert r.exit_code == 3
    assert "DAMAGED" in r.output and "run 'run-b' step 1 entry 'x' chunk 0" in r.output
    assert cli("verify", "-r", str(filled), "run-a").exit_code == 0  # other runs are intact


def test_errors_for_missing_repo_and_bad_names(tmp_path):
    r = cli("ls", "-r", str(tmp_path / "none"))
    assert r.exit_code == 4 and "no luopan repository" in r.output
    luopan.open(tmp_path / "r")
    r = cli("show", "-r", str(tmp_path / "r"), "../etc", "1")
    assert r.exit_code == 2 and "invalid run name" in r.output  # a bad name is a usage error, as a bad NAME@N is
    r = cli("ls", "-r", str(tmp_path / "r"), "bad/../name")
    assert r.exit_code == 2 and "invalid" in r.output


def test_console_script_installed(filled):
    exe = os.path.join(os.path.dirname(sys.executable), "luopan")  # the venv's console script
    assert os.path.exists(exe), "install the package (make setup) so the `luopan` console script exists"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "verify" in out.stdout
    out = subprocess.run([exe, "ls", "-r", str(filled), "--json"], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["runs"][0]["run"] == "run-a"


def test_ls_lists_damaged_manifest_and_exits_3(filled):
    """The readable checkpoints are still listed, the damaged one is named, and the exit code says damage (3)."""
    m = filled / "runs" / "run-a" / "ckpt" / "00000100.json"
    m.write_bytes(m.read_bytes()[:-20])
    r = cli("ls", "-r", str(filled), "run-a", "--json")
    assert r.exit_code == 3
    data = json.loads(r.stdout)
    assert [c["step"] for c in data["checkpoints"]] == [200]
    assert data["damaged"][0]["step"] == 100 and "damaged" in data["damaged"][0]["error"]
    r = cli("ls", "-r", str(filled))
    assert "(+1 damaged)" in r.output
    assert json.loads(cli("du", "-r", str(filled), "--json").stdout)["damaged_manifests"] == 1
    r = cli("verify", "-r", str(filled), "run-a")
    assert r.exit_code == 3 and "00000100.json" in r.output


def test_export_and_diff(filled, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "m.safetensors"
    r = cli("export", "-r", str(filled), "run-a", "100", "-o", str(out))
    assert r.exit_code == 0 and "wrote 3 tensors" in r.output
    got = load_file(str(out))
    src = luopan.open(filled).load("run-a", 100)
    assert set(got) == {"w", "tied", "b"}
    assert torch.equal(got["w"], src["w"]) and torch.equal(got["tied"], src["w"])
    assert torch.equal(got["b"], torch.from_numpy(src["b"]))
    r = cli("export", "-r", str(filled), "run-a", "-o", str(tmp_path / "x.safetensors"), "--subtree", "nope")
    assert r.exit_code == 4 and "no tensors under 'nope'" in r.output and not (tmp_path / "x.safetensors").exists()

    d = json.loads(cli("diff", "-r", str(filled), "run-a", "100", "200", "--json").stdout)
    assert [c["path"] for c in d["changed"]] == ["w", "tied"]
    assert d["changed"][0]["changed_bytes"] == 64 * 1024 and d["changed"][1]["tied_to"] == "w"
    assert d["changed_bytes"] == 64 * 1024 and d["unchanged"] == 1 and d["same_structure"]
    r = cli("diff", "-r", str(filled), "run-a", "100", "200")
    assert r.exit_code == 0 and "2 changed" in r.output


def test_version_and_bad_option_values(tmp_path):
    r = cli("--version")
    assert r.exit_code == 0 and "luopan 0.1.0" in r.output and f"formats 1-{luopan.format.FORMAT_VERSION}" in r.output
    r = cli("init", "-r", str(tmp_path / "x"), "--compression", "zstd:abc")
    assert r.exit_code == 1 and "zstd:LEVEL" in r.output and not (tmp_path / "x" / "luopan.json").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    r = cli("init", "-r", str(tmp_path / "busy"))
    assert r.exit_code == 1 and "not empty" in r.output
    assert cli("ls", "--no-such-flag", "-r", str(tmp_path)).exit_code == 2

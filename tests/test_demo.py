"""The README demo runs, and the CLI works on the repository it made."""

import json
import os
import subprocess
import sys

from .conftest import ROOT


def test_demo_and_cli_on_its_repository(tmp_path):
    repo = str(tmp_path / "demo-repo")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--repo", repo, "--steps", "60",
                          "--every", "20"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "load() bit-exact: True" in out.stdout and "load_into() a fresh model: True" in out.stdout
    luopan_cli = os.path.join(os.path.dirname(sys.executable), "luopan")

    def cli(*args):
        r = subprocess.run([luopan_cli, *args, "-r", repo], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    cps = json.loads(cli("ls", "demo", "--json"))["checkpoints"]
    assert [c["step"] for c in cps] == [20, 40, 60]
    # a fine-tune: the frozen body is written once, later saves write only the head and its optimizer state
    assert cps[1]["stored_bytes"] < cps[0]["stored_bytes"] / 10
    shown = json.loads(cli("show", "demo", "60", "--json"))
    assert shown["metrics"]["loss"] > 0 and any(e["path"].startswith("optim/state/") for e in shown["entries"])
    assert "ok: 3 checkpoint(s)" in cli("verify")
    du = json.loads(cli("du", "--json"))
    assert du["logical_bytes"] > 2 * du["physical_bytes"]
    assert "changed" in cli("diff", "demo", "20", "60")

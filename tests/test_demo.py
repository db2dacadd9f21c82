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
    assert "killed with SIGKILL after step 31" in out.stdout and "restored step 20" in out.stdout
    assert "bit for bit (weights, optimizer, RNG, loss history of 60 steps): True" in out.stdout
    luopan_cli = os.path.join(os.path.dirname(sys.executable), "luopan")

    def cli(*args):
        r = subprocess.run([luopan_cli, *args, "-r", repo], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    cps = json.loads(cli("ls", "resumed", "--json"))["checkpoints"]
    assert [c["step"] for c in cps] == [20, 40, 60]
    # LoRA: the frozen base is written once (by the first run), later saves write the adapters and their state
    straight = json.loads(cli("ls", "straight", "--json"))["checkpoints"]
    assert all(c["stored_bytes"] < straight[0]["stored_bytes"] / 10 for c in straight[1:] + cps)
    shown = json.loads(cli("show", "resumed", "--json"))
    assert shown["metrics"]["loss"] > 0 and any(e["path"].startswith("optimizer/state/") for e in shown["entries"])
    assert shown["record"]["config"]["lora_rank"] == 4 and shown["record"]["config"]["steps"] == 60
    assert "ok: 6 checkpoint(s)" in cli("verify")
    du = json.loads(cli("du", "--json"))
    assert du["logical_bytes"] > 4 * du["physical_bytes"]
    assert "changed" in cli("diff", "resumed", "20", "60")

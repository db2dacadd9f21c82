"""The device side imports almost nothing: a device that only pulls an update channel or applies a patch loads a
few small luopan modules and none of the repository (luopan.repository, luopan.checkpoint, luopan.repo), and a bare
``import luopan`` imports no torch; every public name of luopan still resolves, on first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"  # the checkout under test
LIMIT = 40  # luopan modules a device-side import may load
ENV = {**os.environ, "PYTHONPATH": str(SRC)}
REPOSITORY = ("luopan.repository", "luopan.checkpoint", "luopan.repo", "luopan.artifact", "luopan.cli")


def imported_after(statement: str) -> dict[str, list[str]]:
    """The luopan modules, and whether torch, are in sys.modules after ``statement`` in a fresh interpreter."""
    probe = (f"import sys, json\n{statement}\n"
             "print(json.dumps({'luopan': sorted(m for m in sys.modules if m == 'luopan' or m.startswith('luopan.')),"
             " 'torch': sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))}))")
    proc = subprocess.run([sys.executable, "-c", probe], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{statement!r} failed:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", [
    "from luopan.channel import pull",
    "from luopan.patch import apply",
    "import luopan.patch; luopan.patch.read_header",
    "from luopan.channel import DeviceState, parse_index, read_state",
    "from luopan.patch import fingerprint_file, read_header",
])
def test_the_device_side_imports_no_repository(statement):
    mods = imported_after(statement)["luopan"]
    heavy = [m for m in mods if m.startswith(REPOSITORY)]
    assert not heavy, f"{statement!r} imports {len(mods)} luopan modules, the repository's among them: {heavy}"
    assert len(mods) <= LIMIT, f"{statement!r} imports {len(mods)} luopan modules (limit {LIMIT}): {mods}"


def test_import_luopan_imports_no_torch():
    got = imported_after("import luopan")
    assert not got["torch"], f"import luopan imports torch ({len(got['luopan'])} luopan modules): {got['torch'][:5]}"
    assert len(got["luopan"]) <= LIMIT, f"import luopan imports {len(got['luopan'])} luopan modules: {got['luopan']}"


def test_every_public_name_resolves_to_its_defining_object():
    probe = """
import sys
import luopan
from luopan import Repo, open as lp_open
import luopan.repo, luopan.checkpoint.info, luopan.repository.tiersetup, luopan.policies
missing = [n for n in luopan.__all__ if not hasattr(luopan, n)]
assert not missing, missing
assert set(luopan.__all__) <= set(dir(luopan)), sorted(set(luopan.__all__) - set(dir(luopan)))
assert Repo is luopan.Repo is luopan.repo.Repo and lp_open is luopan.open is luopan.repo.open
assert luopan.init is luopan.repo.init and luopan.policies is sys.modules["luopan.policies"]
assert luopan.CheckpointInfo is luopan.checkpoint.info.CheckpointInfo
assert luopan.ColdPolicy is luopan.repository.tiersetup.ColdPolicy
assert issubclass(luopan.CorruptPatchError, luopan.LuopanError) and luopan.__version__
ns = {}
exec("from luopan import *", ns)
assert set(luopan.__all__) <= set(ns), sorted(set(luopan.__all__) - set(ns))
import luopan.patch, luopan.channel
from luopan.patch import create
from luopan.channel import publish
import luopan.patch.creating, luopan.channel.publishing
assert create is luopan.patch.create is luopan.patch.creating.create and callable(create)
assert publish is luopan.channel.publish is luopan.channel.publishing.publish and callable(publish)
assert {"create", "apply"} <= set(dir(luopan.patch)) and "publish" in dir(luopan.channel)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", probe], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_submodule_imported_first_does_not_hide_the_function():
    """``luopan.channel.publish`` and ``luopan.patch.create`` are the functions even when their modules
    (luopan.channel.publishing, luopan.patch.creating) were imported first: the modules have other names."""
    probe = """
import importlib
importlib.import_module("luopan.channel.publishing")
importlib.import_module("luopan.patch.creating")
import luopan.channel, luopan.patch
assert callable(luopan.channel.publish) and callable(luopan.patch.create)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", probe], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]

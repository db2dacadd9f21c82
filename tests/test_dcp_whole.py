"""A DCP checkpoint read without DCP (issue 31): ``repo.load``, ``load_into`` and ``export`` assemble its sharded
tensors whole (checked against torch's own ``dcp_to_torch_save``), ``pieces=True`` / ``--pieces`` give the shards as
stored, and a damaged layout is a CorruptManifestError. The checkpoint is a real 2-rank DCP save (gloo, CPU)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app

from .conftest import ROOT
from .dcp_worker import column_tensor, full_state
from .test_collective import reseal_manifest
from .test_dcp import spawn

STEP = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(luopan repository, the same state saved by DCP's FileSystemWriter) of one 2-rank save."""
    root = tmp_path_factory.mktemp("dcpwhole")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LUOPAN_CRASH_AT", None)  # as the child_env fixture (function-scoped), once for the module
    proc = spawn(env, "save-sharded-fs", root / "repo", 2, STEP)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    return root / "repo", root / "repo-fs"


def expected() -> dict[str, torch.Tensor]:
    return {**full_state(STEP), "col": column_tensor(STEP)}


def test_load_and_load_into_assemble_the_shards_and_pieces_keeps_them(saved):
    repo_path, _fs = saved
    with luopan.open(repo_path) as repo:
        loaded = repo.load("run")
        assert sorted(loaded) == ["bias", "col", "emb", "meta.step", "proj"]  # DCP's flat names, as ever
        for k, v in expected().items():
            assert torch.equal(loaded[k], v), k
        assert loaded["meta.step"] == STEP
        target = {k: torch.zeros_like(v) for k, v in expected().items()}  # full-size tensors, filled from shards
        assert repo.load_into("run", target=target, strict=False) is target
        for k, v in expected().items():
            assert torch.equal(target[k], v), k
        with pytest.raises(luopan.StateMismatchError, match=r"'emb': checkpoint has torch float32\(64, 32\)"):
            repo.load_into("run", target={"emb": torch.zeros(32, 32)}, strict=False)
        pieces = repo.load("run", pieces=True)  # as stored: each tensor's shards by offset
        assert sorted(pieces["emb"]) == ["shard-0_0", "shard-32_0"] and sorted(pieces["col"]) == ["shard-0_0",
                                                                                                 "shard-0_3"]
        assert torch.equal(pieces["col"]["shard-0_3"], column_tensor(STEP)[:, 3:])
        shard = {"emb": {"shard-0_0": torch.zeros(32, 32), "shard-32_0": torch.zeros(32, 32)}}
        repo.load_into("run", target=shard, strict=False, pieces=True)
        assert torch.equal(shard["emb"]["shard-32_0"], full_state(STEP)["emb"][32:])
        with pytest.raises(luopan.UsageError, match="drop group"):
            repo.load("run", pieces=True, group=True)


def test_export_writes_what_dcp_to_torch_save_does(saved, tmp_path):
    repo_path, fs = saved
    dcp_to_torch_save(fs, tmp_path / "ref.pt")
    reference = torch.load(tmp_path / "ref.pt", weights_only=True)
    tensors = {k: v for k, v in reference.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == ["bias", "col", "emb", "proj"] and reference["meta"] == {"step": STEP}
    with luopan.open(repo_path) as repo:
        info = repo.export("run", path=tmp_path / "whole.safetensors")
        assert info["tensors"] == 4
        whole = load_file(tmp_path / "whole.safetensors")
        assert sorted(whole) == sorted(tensors)
        for k, v in tensors.items():
            assert whole[k].dtype == v.dtype and torch.equal(whole[k], v), k  # rows streamed, columns assembled
        assert repo.export("run", path=tmp_path / "sub.safetensors", subtree="col")["tensors"] == 1
        assert torch.equal(load_file(tmp_path / "sub.safetensors")["col"], tensors["col"])
        repo.export("run", path=tmp_path / "pieces.safetensors", pieces=True)
        assert "emb/shard-32_0" in load_file(tmp_path / "pieces.safetensors")
    cli = CliRunner().invoke(app, ["-r", str(repo_path), "export", "run", "-o", str(tmp_path / "cli.safetensors"),
                                   "--pieces"], catch_exceptions=False)
    assert cli.exit_code == 0, cli.output
    assert sorted(load_file(tmp_path / "cli.safetensors")) == sorted(load_file(tmp_path / "pieces.safetensors"))
    cli = CliRunner().invoke(app, ["-r", str(repo_path), "export", "run", "-o", str(tmp_path / "all.safetensors")],
                             catch_exceptions=False)
    assert cli.exit_code == 0, cli.output
    assert torch.equal(load_file(tmp_path / "all.safetensors")["emb"], tensors["emb"])


def test_a_damaged_dcp_layout_is_a_corrupt_manifest(saved, tmp_path):
    repo_path = tmp_path / "repo"
    shutil.copytree(saved[0], repo_path)

    def chunks(d, fqn):
        return d["dcp"]["tensors"][fqn]["chunks"]

    def storage(d, fqn):
        return [info for (name, _o, _h), info in d["dcp"]["storage"] if name == fqn]

    edits = {
        "lacks": lambda d: chunks(d, "emb")[1][0].__setitem__(0, 31),
        "of size \\[80, 32\\].*hold": lambda d: d["dcp"]["tensors"]["emb"].__setitem__("size", [80, 32]),
        "not its entry's shape": lambda d: chunks(d, "emb")[1][1].__setitem__(0, 31),
        "dtype": lambda d: d["dcp"]["tensors"]["emb"].__setitem__("dtype", "float64"),
        "chunk twice|not its entry": lambda d: storage(d, "emb")[1].__setitem__("entry", storage(d, "emb")[0]["entry"]),
        "chunks in its layout": lambda d: chunks(d, "emb").append([[0, 0], [0, 32]]),
    }
    path = repo_path / "runs" / "run" / "ckpt" / f"{STEP:08d}.json"
    good = path.read_bytes()
    with luopan.open(repo_path) as repo:
        for message, edit in edits.items():
            reseal_manifest(repo_path, "run", STEP, edit)
            for read in (lambda: repo.load("run"), lambda: repo.load_into("run", target={}, strict=False),
                         lambda: repo.export("run", path=tmp_path / "x.safetensors")):
                with pytest.raises(luopan.CorruptManifestError, match=f"DCP layout is damaged.*({message})"):
                    read()
            assert sorted(repo.load("run", pieces=True)["emb"]) == ["shard-0_0", "shard-32_0"]  # pieces: no layout
            path.write_bytes(good)
        assert torch.equal(repo.load("run")["emb"], full_state(STEP)["emb"])

"""Collective saves under torch.distributed (issue 12, part 1): repo.save(..., group=True) on every rank of a gloo
group (2 and 4 processes) is one checkpoint; replicated tensors are written once in total, per-rank ones per rank;
a rank killed mid-save leaves no checkpoint and the others fail with a clear error, not a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import torch

from luopan.format.canonical import inflate_json
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.format.canonical import seal

from .collective_worker import full_sharded, state
from .conftest import PYTHON

WORKER = os.path.join(os.path.dirname(__file__), "collective_worker.py")


def spawn(child_env, op, repo, world, step, timeout=240):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return subprocess.run([PYTHON, WORKER, op, str(repo), str(world), port, str(step)], env=child_env,
                          capture_output=True, timeout=timeout, check=False)


@pytest.mark.parametrize("world", [2, 4])
def test_collective_save_writes_replicated_state_once(tmp_path, child_env, world):
    repo_path = tmp_path / "repo"
    proc = spawn(child_env, "save", repo_path, world, 1)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    info = json.loads((tmp_path / "info.json").read_text())
    replicated = (256 * 64 + 64) * 4
    per_rank = 8 * 4 * world + 2 * 4 * world  # rng, and "kind" (zero bytes everywhere, but dtypes differ)
    # once in total, not world times; "kind"'s equal zero bytes may also be deduplicated between ranks that finish
    # at different times (each rank checks the index files already written), so count them at least once
    assert replicated + 8 * 4 * world + 8 <= info["new_bytes"] <= replicated + per_rank
    packs = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(repo_path / "packs") for f in fs)
    assert packs < 1.05 * (replicated + per_rank) + 4096 * world
    with luopan.open(repo_path) as repo:
        whole = repo.load("run", 1)  # one process: per-rank values by rank
        assert torch.equal(whole["model"]["w"], state(0, 1)["model"]["w"])
        assert sorted(whole["rng"]) == [f"rank-{r}" for r in range(world)]
        assert torch.equal(whole["rng"]["rank-1"], state(1, 1)["rng"])
        assert whole["step"] == 1 and whole["tied"] is whole["model"]["w"]
        assert repo.manifest("run", 1).doc["ranks"] == {"world": world, "per_rank": ["rng", "kind"]}  # leaf order
        assert whole["kind"]["rank-0"].dtype == torch.int32 and whole["kind"]["rank-1"].dtype == torch.float32
        repo.verify()
    proc = spawn(child_env, "load", repo_path, world, 1)  # each rank gets its own values back
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]


def test_a_rank_killed_mid_collective_save_leaves_no_checkpoint(tmp_path, child_env):
    repo_path = tmp_path / "repo"
    assert spawn(child_env, "save", repo_path, 2, 1).returncode == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([PYTHON, WORKER, "save-die", str(repo_path), "3", port, "2", str(r)], env=child_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(3)]
    outcomes = [(p.wait(timeout=200), p.stderr.read()) for p in ranks]  # a hang fails here (TimeoutExpired)
    assert outcomes[2][0] == -9  # the killed rank
    for code, err in outcomes[:2]:  # the survivors: a clear error, nothing committed
        assert code == 17, err.decode()[-3000:]
        assert b"a collective save" in err and b"nothing was committed" in err
    with luopan.open(repo_path) as repo:
        assert repo.steps("run") == [1]
        repo.verify()
        assert torch.equal(repo.load("run", 1)["model"]["w"], state(0, 1)["model"]["w"])


def test_group_needs_torch_distributed(repo):
    with pytest.raises(luopan.UsageError, match="init_process_group"):
        repo.save("r", 1, {"x": torch.ones(2)}, group=True)
    with pytest.raises(luopan.UsageError, match="does not take"):
        import torch.distributed as dist  # noqa: F401

        repo.save("r", 1, {"x": torch.ones(2)}, group=True, trust_versions=True)
    assert repo.steps("r") == []


# -- sharded entries (issue 12, part 3): luopan.Shard, DTensor ------------------------------------------------------
def reseal_manifest(repo_path, run, step, edit):
    path = repo_path / "runs" / run / "ckpt" / f"{step:08d}.json"
    doc = json.loads(inflate_json(path.read_bytes()))  # a zstd frame in format-5 repositories (docs/format.md §4)
    doc.pop("checksum")
    edit(doc)
    path.write_bytes(seal(doc))


def test_sharded_collective_save_is_stored_once_and_loads_whole_or_per_rank(tmp_path, child_env):
    repo_path = tmp_path / "repo"
    proc = spawn(child_env, "save-shards", repo_path, 2, 1)  # also: disagreeing shards are refused on every rank
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    full = full_sharded(1, 2)
    global_bytes = sum(v.nbytes for v in full.values() if isinstance(v, torch.Tensor))
    rng = 2 * 4 * 4
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["logical"] == global_bytes + rng  # every shard once: tied, replicated and DTensor-replicated too
    assert global_bytes <= info["new_bytes"] <= global_bytes + rng
    packs = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(repo_path / "packs") for f in fs)
    assert packs < 1.05 * (global_bytes + rng) + 8192
    with luopan.open(repo_path) as repo:
        assert repo.steps("run") == [1]  # the refused saves left nothing
        whole = repo.load("run", 1)  # one process: sharded tensors assembled, bit-exact
        for k in ("emb", "col", "bias", "dt", "dt_rep", "tiny", "st"):
            assert type(whole[k]) is torch.Tensor and torch.equal(whole[k], full[k]), k
        assert whole["tied"] is whole["emb"] and whole["step"] == 1
        assert sorted(whole["rng"]) == ["rank-0", "rank-1"] and whole["rng"]["rank-1"][0] == 11
        ranks = repo.manifest("run", 1).doc["ranks"]
        assert ranks["world"] == 2 and ranks["per_rank"] == ["rng"]
        assert sorted(ranks["sharded"]) == ["col", "dt", "dt_rep", "emb", "st", "tiny"]
        emb = ranks["sharded"]["emb"]
        assert emb["size"] == [259, 64]
        assert [c[:2] for c in emb["chunks"]] == [[[0, 0], [130, 64]], [[130, 0], [129, 64]]]
        assert [c[3] for c in ranks["sharded"]["dt_rep"]["chunks"]] == [[0, 1]]  # one chunk, held by both
        paths = {e["path"] for e in repo.manifest("run", 1).entries}
        assert {"emb/shard-0_0", "emb/shard-130_0", "col/shard-0_8", "dt_rep/shard-0", "tiny/shard-1_0"} <= paths
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in full.items()}
        target["tied"] = target["emb"]
        target["rng"] = {"rank-0": torch.zeros(4), "rank-1": torch.zeros(4)}
        repo.load_into("run", target, 1)  # into whole tensors: assembled in place
        assert all(torch.equal(target[k], full[k]) for k in ("emb", "col", "dt", "dt_rep", "bias", "tiny", "st"))
        with pytest.raises(luopan.StateMismatchError, match=r"'emb': checkpoint has torch float32\(259, 64\)"):
            repo.load_into("run", {**target, "emb": torch.zeros(130, 64)}, 1)
        repo.verify()
        out = repo.export("run", path=tmp_path / "x.safetensors", pieces=True)
        assert out["tensors"] == len(paths)
        whole = repo.export("run", path=tmp_path / "y.safetensors")  # the sharded tensors assembled, one each
        sharded_paths = {p for p in paths if "/shard-" in p}
        assert whole["tensors"] == len(paths) - len(sharded_paths) + len(ranks["sharded"])
        from safetensors.torch import load_file

        exported = load_file(tmp_path / "y.safetensors")
        assert all(torch.equal(exported[k], full[k]) for k in ("emb", "col", "dt", "dt_rep", "tiny", "st"))
    verified = CliRunner().invoke(app, ["-r", str(repo_path), "verify"], catch_exceptions=False)
    assert verified.exit_code == 0, verified.output
    proc = spawn(child_env, "load-shards", repo_path, 2, 1)  # each rank: its own shards, reading only their chunks
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    proc = spawn(child_env, "load-shards-world", repo_path, 1, 1)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    check_damaged_layouts(repo_path)


def check_damaged_layouts(repo_path):
    """A damaged shard layout in a (sealed) manifest is a CorruptManifestError, never an IndexError or garbage."""
    path = repo_path / "runs" / "run" / "ckpt" / f"{1:08d}.json"
    good = path.read_bytes()

    def chunk(k):
        return lambda d: d["ranks"]["sharded"]["emb"]["chunks"][k]

    edits = {
        "outside": lambda d: chunk(1)(d)[0].__setitem__(0, 200),
        "not its entry's shape": lambda d: chunk(0)(d)[1].__setitem__(0, 129),
        "overlap|hold": lambda d: chunk(1)(d)[0].__setitem__(0, 0),
        "name each of the 2 ranks": lambda d: chunk(1)(d)[3].__setitem__(0, 0),
        "an entry of": lambda d: chunk(0)(d).__setitem__(2, 10**6),
        "is not \\[offsets": lambda d: chunk(0)(d).pop(),
        "size of": lambda d: d["ranks"]["sharded"]["emb"].__setitem__("size", [259, "64"]),
        "world": lambda d: d["ranks"].__setitem__("world", 0),
    }
    with luopan.open(repo_path) as repo:
        for message, edit in edits.items():
            reseal_manifest(repo_path, "run", 1, edit)
            for read in (lambda: repo.load("run", 1), lambda: repo.load_into("run", {}, 1, strict=False)):
                with pytest.raises(luopan.CorruptManifestError, match=f"ranks member is damaged.*({message})"):
                    read()
            path.write_bytes(good)
        assert torch.equal(repo.load("run", 1)["emb"], full_sharded(1, 2)["emb"])


def test_shard_declarations_are_checked_and_only_collective_saves_take_them(repo):
    with pytest.raises(luopan.UsageError, match="does not fit in the global shape"):
        luopan.Shard(torch.zeros(2, 3), (4, 3), (3, 0))
    with pytest.raises(luopan.UsageError, match="one of each per dimension"):
        luopan.Shard(torch.zeros(2), (4, 3), (0, 0))
    with pytest.raises(luopan.ArgumentTypeError, match="torch tensor or NumPy array"):
        luopan.Shard([1, 2], (4,), (0,))
    with pytest.raises(luopan.ArgumentTypeError, match="must hold ints"):
        luopan.Shard(torch.zeros(2), (4.0,), (0,))
    with pytest.raises(luopan.UnsupportedValueError, match="Shard"):
        repo.save("r", 1, {"w": luopan.Shard(torch.zeros(2), (4,), (2,))})


def test_a_shard_replicated_on_more_than_64_ranks_reads_back_and_bad_layouts_are_not_committed():
    from luopan.checkpoint.distributed.ranks import check_member, ranks_member

    entries = [{"path": "w/shard-0", "kind": "torch", "dtype": "float32", "shape": [4]}]
    member = ranks_member(65, [], {"w": ("float32", (4,), [((0,), (4,), 0, tuple(range(65)))])})
    check_member(member, entries)  # 65 ranks hold the one shard: readable
    gap = ranks_member(2, [], {"w": ("float32", (8,), [((0,), (4,), 0, (0, 1))])})
    with pytest.raises(luopan.UsageError, match="nothing was committed"):
        check_member(gap, entries)

"""Collective saves under torch.distributed (issue 12, part 1): repo.save(..., group=True) on every rank of a gloo
group (2 and 4 processes) is one checkpoint; replicated tensors are written once in total, per-rank ones per rank;
a rank killed mid-save leaves no checkpoint and the others fail with a clear error, not a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
import torch

import luopan

from .collective_worker import state
from .conftest import PYTHON

WORKER = os.path.join(os.path.dirname(__file__), "collective_worker.py")


def spawn(child_env, op, repo, world, step, timeout=240):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return subprocess.run([PYTHON, WORKER, op, str(repo), str(world), port, str(step)], env=child_env,
                          capture_output=True, timeout=timeout)


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
    start = time.monotonic()
    ranks = [subprocess.Popen([PYTHON, WORKER, "save-die", str(repo_path), "3", port, "2", str(r)], env=child_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(3)]
    outcomes = [(p.wait(timeout=200), p.stderr.read()) for p in ranks]
    assert time.monotonic() - start < 150  # the group's 20 s timeout at most, not a hang
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

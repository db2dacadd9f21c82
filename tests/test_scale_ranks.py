"""Collective saves whose ranks each have a local tier of their own, tiered to one S3 server (issue 30, many ranks,
many nodes; docs/format.md §10.5): every rank's packs go to the remote before rank 0 commits, so the checkpoint loads
bit-exact on every rank (and from the remote alone); replicated tensors are written once in total; a save lists the
object store at most once; a rank killed mid-save leaves nothing committed anywhere, the survivors get a
CollectiveError, and the previous checkpoint still loads on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import s3fs
import torch

import luopan

from .conftest import PYTHON
from . import s3server
from .s3server import fresh_url
from .tiered_collective_worker import replicated_bytes, state

s3_endpoint = s3server.s3_endpoint  # the module-scoped fixture: a moto S3 server for this module
WORKER = os.path.join(os.path.dirname(__file__), "tiered_collective_worker.py")


def ranks(child_env, op, base, url, world, steps, timeout=120):
    """Run ``op`` on ``world`` ranks (one process each); their exit codes, stderr and reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([PYTHON, WORKER, op, str(base), url, str(world), port, str(steps), str(r)],
                              env=child_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(world)]
    done = [(p.wait(timeout=timeout), p.stderr.read().decode()[-3000:]) for p in procs]  # a hang fails here
    reports = []
    for r in range(world):
        path = os.path.join(base, f"{op}-rank{r}.json")
        reports.append(json.load(open(path)) if os.path.exists(path) else None)
    return done, reports


def remote_pack_bytes(endpoint, url):
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    return sum(fs.du(url.split("://", 1)[1] + "/packs", total=False).values())


def test_spread_ranks_save_once_to_the_remote_and_load_on_every_rank(s3_endpoint, child_env, tmp_path):
    url, world = fresh_url(), 4
    done, reports = ranks(child_env, "save-load", tmp_path, url, world, 2)
    assert all(code == 0 for code, _err in done), [err for _c, err in done]
    # one listing of the object store per save in all (the remote shared lock of rank 0's replication)
    for step in range(2):
        assert sum(r["lists"][step] for r in reports) <= 1, [r["lists"] for r in reports]
    # replicated tensors once: the first save's new chunk bytes are the state's, replicated tensors counted once
    unique = replicated_bytes(world)
    assert reports[0]["new_bytes"] == [unique, unique]  # every byte of step 2's state differs from step 1's
    assert 2 * unique <= remote_pack_bytes(s3_endpoint, url) <= 2 * (1.05 * unique + 4096 * world)
    # every rank's local tier holds its own part only; the remote holds the whole checkpoint
    local_packs = [sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(tmp_path / f"node{r}" / "packs")
                       for f in fs) for r in range(world)]
    assert all(0 < b < unique for b in local_packs)
    with luopan.open(url) as remote:  # a new node: the remote alone
        assert remote.steps("run") == [1, 2]
        whole = remote.load("run", 2)
        want = [state(r, world, 2) for r in range(world)]
        assert torch.equal(whole["emb"], torch.cat([w["emb"].tensor for w in want]))
        assert torch.equal(whole["model"]["w"], want[0]["model"]["w"])
        assert torch.equal(whole["rng"]["rank-3"], want[3]["rng"])
        remote.verify()
    # a fresh group of new processes loads it back bit-exact on every rank (other ranks' packs from the remote)
    done, reports = ranks(child_env, "load", tmp_path, url, world, 2)
    assert all(code == 0 for code, _err in done), [err for _c, err in done]


def test_a_spread_rank_killed_mid_save_leaves_nothing_committed(s3_endpoint, child_env, tmp_path):
    url, world = fresh_url(), 3
    done, _reports = ranks(child_env, "save-load", tmp_path, url, world, 1)
    assert all(code == 0 for code, _err in done), [err for _c, err in done]
    done, reports = ranks(child_env, "save-die", tmp_path, url, world, 2)
    assert done[-1][0] == -9  # killed once its packs were on the remote
    for (code, err), report in zip(done[:-1], reports[:-1]):  # the survivors: a clear CollectiveError
        assert code == 17, err
        assert report["error"].startswith("CollectiveError") and "nothing was committed" in report["error"]
    with luopan.open(url) as remote:  # no manifest on the remote: the dead rank's packs are garbage for gc
        assert remote.steps("run") == [1]
        remote.verify()
    for r in range(world):
        with luopan.open(tmp_path / f"node{r}") as repo:
            assert repo.steps("run") == [1]
    done, reports = ranks(child_env, "load", tmp_path, url, world, 1)  # the previous checkpoint, on every rank
    assert all(code == 0 for code, _err in done), [err for _c, err in done]
    assert all(r["steps"] == [1] for r in reports)


def test_a_new_local_tier_adopts_the_remote_repository(s3_endpoint, tmp_path):
    url = fresh_url()
    with luopan.open(tmp_path / "a", replicate_to=url, chunk_size=64 << 10) as first:
        first.save("run", 1, {"x": torch.arange(10)})
        assert first.tier.wait(30)
        repo_id = first.config.repo_id
    with luopan.open(tmp_path / "b", replicate_to=url) as second:  # a node joining: same repository
        assert second.config.repo_id == repo_id and second.config.chunk_size == 64 << 10
        assert torch.equal(second.load("run", 1)["x"], torch.arange(10))
    with pytest.raises(luopan.errors.ConfigConflictError, match="chunk_size"):
        luopan.open(tmp_path / "c", replicate_to=url, chunk_size=128 << 10)

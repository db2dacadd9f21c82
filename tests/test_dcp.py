"""luopan.dcp: PyTorch Distributed Checkpoint through a luopan repository (issue 12, part 2). Single-process saves and
loads, and real torch.distributed runs (gloo, CPU, several processes) saving sharded state at world size 4 and
loading it at 4, 2 and 1; replicated state written once; a rank killed mid-save leaves no checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import luopan
import luopan.dcp

from .conftest import PYTHON
from .dcp_worker import full_state

WORKER = os.path.join(os.path.dirname(__file__), "dcp_worker.py")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def spawn(child_env, op: str, repo, world: int, step: int, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, WORKER, op, str(repo), str(world), free_port(), str(step)], env=child_env,
                          capture_output=True, timeout=timeout)


@pytest.fixture(autouse=True)
def quiet_single_process_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def model_state(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": 5, "extra": {"name": "x", "lr": 1e-3}}


def test_single_process_save_load_and_the_normal_tools(tmp_path):
    repo_path = tmp_path / "repo"
    sd = model_state(0)
    writer = luopan.dcp.Writer(repo_path, "run-a", step=10, metrics={"loss": 0.3})
    dcp.save(sd, storage_writer=writer)
    assert writer.info.step == 10 and 0 < writer.info.new_bytes <= writer.info.logical_bytes  # equal chunks once
    target = model_state(1)
    target["step"], target["extra"] = 0, {}
    dcp.load(target, storage_reader=luopan.dcp.Reader(repo_path, "run-a"))
    for k, v in sd["model"].items():
        assert torch.equal(target["model"][k], v)
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], sd["optim"]["state"][0]["exp_avg"])
    assert target["optim"]["param_groups"][0]["lr"] == sd["optim"]["param_groups"][0]["lr"]
    assert target["step"] == 5
    with luopan.open(repo_path) as repo:  # a DCP checkpoint lists, verifies, loads and prunes like any other
        assert [c.step for c in repo.checkpoints("run-a")] == [10] and repo.checkpoints("run-a")[0].metrics == \
            {"loss": 0.3}
        repo.verify("run-a")
        flat = repo.load("run-a")
        assert torch.equal(flat["model.0.weight"], sd["model"]["0.weight"]) and flat["step"] == 5
        dcp.save(sd, storage_writer=luopan.dcp.Writer(repo, "run-a", step=11))  # unchanged: nothing new written
        assert repo.checkpoints("run-a")[-1].new_bytes == 0
        repo.prune("run-a", luopan.retention.KeepLast(1))
        repo.gc(grace=0)
        repo.verify()
    with pytest.raises(CheckpointException, match="already has a checkpoint at step 11"):  # DCP wraps errors
        dcp.save(sd, storage_writer=luopan.dcp.Writer(repo_path, "run-a", step=11))


class Opaque:
    """A class DCP's planner pickles and luopan refuses to store (it would have to unpickle it)."""


def test_values_dcp_pickles_are_stored_as_json_and_refused_when_unsafe(tmp_path):
    with pytest.raises(CheckpointException, match="will not store"):
        dcp.save({"w": torch.ones(2), "cfg": Opaque()}, storage_writer=luopan.dcp.Writer(tmp_path / "r", "x", 1))
    with luopan.open(tmp_path / "r") as repo:
        assert repo.steps("x") == []  # nothing committed
    with pytest.raises(CheckpointException, match="not written through luopan.dcp"):
        with luopan.open(tmp_path / "r") as repo:
            repo.save("plain", 1, {"w": torch.ones(2)})
        dcp.load({"w": torch.zeros(2)}, storage_reader=luopan.dcp.Reader(tmp_path / "r", "plain"))


def test_sharded_save_at_4_loads_at_4_2_and_1(tmp_path, child_env):
    repo_path = tmp_path / "repo"
    proc = spawn(child_env, "save-sharded", repo_path, 4, 3)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    for world in (4, 2):
        proc = spawn(child_env, "load-sharded", repo_path, world, 3)
        assert proc.returncode == 0, (world, proc.stderr.decode()[-4000:])
    target = {k: torch.zeros_like(v) for k, v in full_state(3).items()}  # one process: the shards assembled
    target["meta"] = {}
    dcp.load(target, storage_reader=luopan.dcp.Reader(repo_path, "run", 3))
    for k, v in full_state(3).items():
        assert torch.equal(target[k], v), k
    with luopan.open(repo_path) as repo:
        info = repo.checkpoints("run")[0]
        assert info.logical_bytes == sum(v.numel() * v.element_size() for v in full_state(3).values())
        assert torch.equal(repo.load("run")["emb"], full_state(3)["emb"])  # without DCP: assembled whole
        loaded = repo.load("run", pieces=True)  # or each tensor's shards by offset
        assert sorted(loaded["emb"]) == ["shard-0_0", "shard-16_0", "shard-32_0", "shard-48_0"]
        repo.verify()


def test_replicated_state_is_written_once(tmp_path, child_env):
    proc = spawn(child_env, "save-replicated", tmp_path / "repo", 2, 1)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    state_bytes = sum(v.numel() * v.element_size() for v in full_state(1).values())
    with luopan.open(tmp_path / "repo") as repo:
        info = repo.checkpoints("ddp")[0]
        assert info.logical_bytes == state_bytes and info.new_bytes == state_bytes  # 1x, not 2x
        assert sum(repo.store.size(k) for k in repo.store.list("packs/")) < 1.05 * state_bytes + 4096


def test_a_rank_killed_mid_save_leaves_no_checkpoint(tmp_path, child_env):
    repo_path = tmp_path / "repo"
    proc = spawn(child_env, "save-sharded", repo_path, 2, 1)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    proc = spawn(child_env, "save-die", repo_path, 2, 2, timeout=200)
    assert proc.returncode != 0  # the survivor fails (a closed connection, or the 30 s collective timeout)
    with luopan.open(repo_path) as repo:
        assert repo.steps("run") == [1]  # step 2 never became visible
        repo.verify()
    target = {k: torch.zeros_like(v) for k, v in full_state(1).items()}
    target["meta"] = {}
    dcp.load(target, storage_reader=luopan.dcp.Reader(repo_path, "run"))  # the previous checkpoint loads
    assert torch.equal(target["emb"], full_state(1)["emb"])


def test_async_save_stages_then_commits(tmp_path):
    sd = {"w": torch.randn(100, 10), "step": 3}
    fut = dcp.async_save(sd, storage_writer=luopan.dcp.Writer(tmp_path / "r", "r", 1))
    sd["w"].add_(1)  # async_save staged a copy: the caller may change the state at once
    fut.result()
    target = {"w": torch.zeros(100, 10), "step": 0}
    dcp.load(target, storage_reader=luopan.dcp.Reader(tmp_path / "r", "r", 1))
    assert torch.equal(target["w"] + 1, sd["w"]) and target["step"] == 3


def test_a_part_whose_reused_pack_vanished_is_not_committed(repo):
    """commit_entries checks, under its lock, that every pack the parts name is still there (a gc may have swept
    a pack a part reused between the part and the commit)."""
    stored = repo.store_entries([("w", torch.arange(1000.0))])
    for key in list(repo.store.list("packs/")):
        repo.store.delete(key)
    with pytest.raises(luopan.MissingPackError, match="was not committed"):
        repo.commit_entries("r", 1, stored.entries, {"dict": [["w", {"entry": 0}]]})
    assert repo.steps("r") == []


def test_readme_dcp_example_runs_as_written(tmp_path, child_env):
    import re

    from .conftest import ROOT

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "luopan.dcp.Writer" in b]
    proc = subprocess.run([PYTHON, "-c", block], cwd=tmp_path, env=child_env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    with luopan.open(tmp_path / "ckpts") as repo:
        assert repo.steps("run-dcp") == [100]


def _spy_store_entries(monkeypatch) -> list[list[str]]:
    """The key paths each store_entries call was given (the items a Writer read and hashed)."""
    from luopan.checkpoint.distributed.parts import Parts

    calls: list[list[str]] = []
    original = Parts.store_entries

    def spy(self, tensors):
        calls.append([path for path, _ in tensors])
        return original(self, tensors)

    monkeypatch.setattr(Parts, "store_entries", spy)
    return calls


def _chunks(repo, run: str, step: int) -> dict[str, list[str]]:
    m = repo.manifest(run, step)
    return {e["path"]: [m.doc["packs"][r[1]] + ":" + r[0] for r in e["chunks"]] for e in m.doc["entries"]}


def test_trust_versions_resave_reads_only_tensors_whose_version_moved(tmp_path, monkeypatch):
    calls = _spy_store_entries(monkeypatch)
    m = torch.nn.Linear(64, 32)
    frozen = torch.randn(300, 100)
    sd = {"model": m.state_dict(), "frozen": frozen, "other": torch.randn(50), "step": 1}
    dcp.save(sd, storage_writer=luopan.dcp.Writer(tmp_path / "r", "t", 1, trust_versions=True))
    assert sorted(calls[-1]) == ["frozen", "model.bias", "model.weight", "other"]
    with torch.no_grad():
        m.weight.add_(1)  # in place: its version counter moves
    sd = {"model": m.state_dict(), "frozen": frozen, "other": torch.randn(50), "step": 2}  # a fresh state_dict()
    dcp.save(sd, storage_writer=luopan.dcp.Writer(tmp_path / "r", "t", 2, trust_versions=True))
    assert sorted(calls[-1]) == ["model.weight", "other"]  # "other" is a new tensor object: read again
    with luopan.open(tmp_path / "r") as repo:
        one, two = _chunks(repo, "t", 1), _chunks(repo, "t", 2)
        assert one["frozen"] == two["frozen"] and one["model.bias"] == two["model.bias"]  # the same chunks, unread
        assert one["model.weight"] != two["model.weight"] and one["other"] != two["other"]
        assert repo.checkpoints("t")[-1].new_bytes == (64 * 32 + 50) * 4
        repo.verify("t")
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "frozen": torch.zeros(300, 100),
              "other": torch.zeros(50), "step": 0}
    dcp.load(target, storage_reader=luopan.dcp.Reader(tmp_path / "r", "t", 2))
    for k, v in sd["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert torch.equal(target["frozen"], frozen) and torch.equal(target["other"], sd["other"])
    assert target["step"] == 2
    dcp.save(sd, storage_writer=luopan.dcp.Writer(tmp_path / "r", "t", 3))  # without trust_versions: all read
    assert sorted(calls[-1]) == ["frozen", "model.bias", "model.weight", "other"]


def test_trust_versions_rehashes_items_whose_packs_gc_removed(tmp_path, monkeypatch):
    calls = _spy_store_entries(monkeypatch)
    sd = {"a": torch.randn(1000), "b": torch.randn(20, 20)}
    with luopan.open(tmp_path / "r") as repo:
        dcp.save(sd, storage_writer=luopan.dcp.Writer(repo, "t", 1, trust_versions=True))
        repo.delete("t", 1)
        repo.gc(grace=0)  # the packs of step 1 are gone
        assert list(repo.store.list("packs/")) == []
        dcp.save(sd, storage_writer=luopan.dcp.Writer(repo, "t", 2, trust_versions=True))
        assert sorted(calls[-1]) == ["a", "b"]  # unchanged, but their previous chunks are gone: stored again
        repo.verify("t")
        loaded = repo.load("t", 2)
        assert torch.equal(loaded["a"], sd["a"]) and torch.equal(loaded["b"], sd["b"])

        # A gc between the writes and the commit: the commit refuses a manifest naming a removed pack.
        writer = luopan.dcp.Writer(repo, "t", 3, trust_versions=True)
        finish = writer.finish

        def gc_then_finish(metadata, results):
            repo.delete("t", 2)
            repo.gc(grace=0)
            return finish(metadata, results)

        writer.finish = gc_then_finish
        n = len(calls)
        with pytest.raises(CheckpointException, match="was not committed"):
            dcp.save(sd, storage_writer=writer)
        assert len(calls) == n  # step 3 reused everything, read nothing
        assert repo.steps("t") == []
        dcp.save(sd, storage_writer=luopan.dcp.Writer(repo, "t", 3, trust_versions=True))  # saving again works
        assert repo.load("t", 3)["b"].equal(sd["b"])
        repo.verify("t")


def test_reader_refuses_ranks_that_resolved_different_latest_steps(tmp_path):
    """With step=None each rank resolves "latest" itself; a commit between two ranks' reads must not load a mix."""
    from torch.distributed.checkpoint.planner import LoadPlan

    with luopan.open(tmp_path / "r") as repo:
        for step in (1, 2):
            dcp.save({"w": torch.full((4,), float(step))}, storage_writer=luopan.dcp.Writer(repo, "run", step))
    early = luopan.dcp.Reader(tmp_path / "r", "run", step=1)
    late = luopan.dcp.Reader(tmp_path / "r", "run")  # latest: 2
    plans = [early.prepare_local_plan(LoadPlan([])), late.prepare_local_plan(LoadPlan([]))]
    assert [p.storage_data["luopan_step"] for p in plans] == [1, 2]
    with pytest.raises(luopan.UsageError, match="different latest checkpoints"):
        late.prepare_global_plan(plans)
    assert late.prepare_global_plan(plans[1:] * 2) == plans[1:] * 2
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=luopan.dcp.Reader(tmp_path / "r", "run"))  # one process: the check passes
    assert torch.equal(state["w"], torch.full((4,), 2.0))


def test_trust_versions_never_reuses_staged_copies_of_async_save(tmp_path):
    """A stager passed to several async_saves refreshes the same CPU copies with storage-level copies that never
    move a version counter: the Writer must not take them as unchanged."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    w = torch.nn.Linear(8, 8)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    with luopan.open(tmp_path / "r") as repo:
        for step in (1, 2, 3):
            with torch.no_grad():
                w.weight.add_(1.0)
            result = dcp.async_save(w.state_dict(), storage_writer=luopan.dcp.Writer(repo, "r", step,
                                                                                     trust_versions=True),
                                    async_stager=stager, no_dist=True)
            getattr(result, "upload_completion", result).result()
            assert torch.equal(repo.load("r", step)["weight"], w.weight.detach()), step
    stager.close()


def test_a_writer_given_a_path_keeps_the_repository_open_for_the_next_save(tmp_path):
    """luopan.dcp.opened: the next save at the same path stores through the repository the last one opened (its chunk
    index and XXH3 rows in memory); one removed and created again at that path, or one still in use, is not reused."""
    from luopan.dcp import opened

    opened.forget()
    path = tmp_path / "repo"
    w1 = luopan.dcp.Writer(path, "r", 1)
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=w1)
    w2 = luopan.dcp.Writer(str(path), "r", 2)
    dcp.save({"w": torch.arange(1000.0) + 1}, storage_writer=w2)
    assert w2._repo is w1._repo
    first = opened.acquire(path)  # in use by a save: the next acquire gets a repository of its own
    assert opened.acquire(path) is not first
    opened.release(first)
    import shutil
    shutil.rmtree(path)  # the same path, another repository (another repo_id): never the old one's memory
    w3 = luopan.dcp.Writer(path, "r", 1)
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=w3)
    assert w3._repo is not w1._repo
    out = {"w": torch.zeros(1000)}
    dcp.load(out, storage_reader=luopan.dcp.Reader(path, "r", 1))
    assert torch.equal(out["w"], torch.arange(1000.0))
    opened.forget()


def test_a_save_refused_for_an_existing_step_leaves_the_kept_repository_to_the_next(tmp_path):
    from luopan.dcp import opened

    opened.forget()
    path = tmp_path / "repo"
    first = luopan.dcp.Writer(path, "r", 1)
    dcp.save({"w": torch.ones(10)}, storage_writer=first)
    with pytest.raises(CheckpointException, match="already has a checkpoint"):
        dcp.save({"w": torch.ones(10)}, storage_writer=luopan.dcp.Writer(path, "r", 1))
    again = luopan.dcp.Writer(path, "r", 2)
    dcp.save({"w": torch.ones(10)}, storage_writer=again)
    assert again._repo is first._repo
    opened.forget()

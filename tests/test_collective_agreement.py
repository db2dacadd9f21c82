"""Collective saves and loads whose ranks disagree (issue 27, items 8 and 9), in a real gloo group of 2 processes
(tests/collective_agree_worker.py runs every scenario in one group; each rank reports what it saw):

- ties are per rank: a rank that ties two key paths gets them back tied, a rank that does not gets its own values;
- ranks that pass different runs, steps, overwrite flags or tree structures all get one CollectiveError naming the
  disagreement and what each rank passed, and nothing is committed; the same for run and step of a collective load;
- the agreement costs no extra collective round trip on a save and one on a load.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import torch

import luopan

from .conftest import PYTHON

WORKER = os.path.join(os.path.dirname(__file__), "collective_agree_worker.py")


def _tensor(value: float, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + value


def _run_worker(op, repo_path, base):
    """[rank 0's report, rank 1's report] of one run of the worker (``op``: save or load) on ``repo_path``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.dirname(__file__)), "src") + os.pathsep + \
        env.get("PYTHONPATH", "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = [base / f"{op}-rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([PYTHON, WORKER, op, str(repo_path), port, str(r), str(out[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    errors = []
    try:
        for p in procs:
            _out, err = p.communicate(timeout=300)  # the group's own timeout is 60 s: a hang ends long before
            errors.append(err.decode(errors="replace")[-4000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert all(p.returncode == 0 for p in procs), errors
    return [json.loads(path.read_text()) for path in out]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(repository path, [rank 0's report, rank 1's report]) of the save scenarios."""
    base = tmp_path_factory.mktemp("agree")
    repo_path = base / "repo"
    with luopan.open(repo_path):  # created here, before the ranks open it
        pass
    return repo_path, _run_worker("save", repo_path, base)


@pytest.fixture(scope="module")
def loaded(saved):
    """(repository path, reports) of the load scenarios, on what the save scenarios saved."""
    return saved[0], _run_worker("load", saved[0], saved[0].parent)


def both(saved, name):
    return [report[name] for report in saved[1]]


def refused(saved, name, *needles):
    """Every rank got one CollectiveError naming ``needles``, and said nothing was committed."""
    for rank, got in enumerate(both(saved, name)):
        assert "error" in got, (name, rank, got)
        assert got["collective"], (name, rank, got)
        said = "nothing was loaded" if name.startswith("load") or (name == "mixed" and rank == 0) else \
            "nothing was committed"
        assert said in got["message"], got["message"]
        for needle in needles:
            assert needle in got["message"], (name, rank, needle, got["message"])
    return [got["message"] for got in both(saved, name)]


# -- item 8: ties are per rank -------------------------------------------------------------------------------------
def test_a_tie_on_one_rank_only_gives_each_rank_its_own_values(saved):
    assert both(saved, "tie0-save") == [{"ok": 1}, {"ok": 1}]
    rank0, rank1 = both(saved, "tie0-load")
    assert rank0 == {"ok": {"a": True, "b": True, "tied": True}}  # tied on the rank that tied them
    assert rank1 == {"ok": {"a": True, "b": True, "tied": False}}  # rank 1's own "b", not rank 0's
    assert both(saved, "tie0-load-into") == [{"ok": {"a": True, "b": True}}] * 2
    with luopan.open(saved[0]) as repo:
        whole = repo.load("tie0", 1)  # one process: per-rank values by rank, rank 0's still tied
        assert whole["b"]["rank-0"] is whole["a"]["rank-0"]
        assert torch.equal(whole["a"]["rank-1"], _tensor(10.0)) and torch.equal(whole["b"]["rank-1"], _tensor(15.0))
        assert torch.equal(whole["b"]["rank-0"], _tensor(0.0))
        assert sorted(repo.manifest("tie0", 1).doc["ranks"]["per_rank"]) == ["a", "b"]
        assert "b/rank-0" not in {e["path"] for e in repo.manifest("tie0", 1).entries}  # stored once
        repo.verify()


def test_a_tie_to_a_replicated_tensor_on_another_rank_than_0(saved):
    assert both(saved, "tie1-save") == [{"ok": 1}, {"ok": 1}]
    rank0, rank1 = both(saved, "tie1-load")
    assert rank0 == {"ok": {"a": True, "b": True, "c": True, "tied": False}}
    assert rank1 == {"ok": {"a": True, "b": True, "c": True, "tied": True}}
    with luopan.open(saved[0]) as repo:
        whole = repo.load("tie1", 1)
        assert whole["b"]["rank-1"] is whole["a"] and torch.equal(whole["b"]["rank-0"], _tensor(7.0))
        assert repo.manifest("tie1", 1).doc["ranks"]["per_rank"] == ["b"]
        repo.verify()


# -- item 9: run, step, overwrite and structure must agree ----------------------------------------------------------
def test_ranks_passing_different_runs_are_refused_on_every_rank(saved):
    for message in refused(saved, "run", "run", "'agree-a'", "'agree-b'"):
        assert "rank 0" in message and "rank 1" in message
    steps = saved[1][0]["steps"]
    assert steps["agree-a"] == [] and steps["agree-b"] == []


def test_ranks_passing_different_steps_are_refused_on_every_rank(saved):
    refused(saved, "step", "step", "5", "6", "rank 0", "rank 1")
    assert 5 not in saved[1][0]["steps"]["agree"] and 6 not in saved[1][0]["steps"]["agree"]


def test_ranks_passing_different_overwrite_flags_are_refused(saved):
    refused(saved, "overwrite", "overwrite", "rank 0", "rank 1")


def test_ranks_with_different_key_paths_or_values_are_refused_naming_them(saved):
    refused(saved, "keys", "'extra'", "rank 1")
    refused(saved, "value", "'lr'", "0.1", "0.2")
    assert saved[1][0]["steps"]["agree"] == [9]  # only the good save


def test_the_agreement_costs_no_extra_round_trip(saved):
    assert both(saved, "good") == [{"ok": 9}, {"ok": 9}]
    for calls in both(saved, "save-collectives"):  # each rank's report (with the agreement), whether every part
        # is stored, the parts' entries to rank 0 only (not to every rank: world^2 bytes), the outcome
        assert calls == ["all_gather_object", "all_gather_object", "gather_object", "all_gather_object"], calls


# -- collective loads --------------------------------------------------------------------------------------------
def test_collective_loads_of_different_runs_or_steps_are_refused(loaded):
    refused(loaded, "load-run", "run", "'agree'", "'tie0'", "nothing was loaded")
    refused(loaded, "load-step", "step", "rank 0 passed 9", "rank 1 passed None (the latest)")
    refused(loaded, "load-into-step", "step", "rank 0 passed 1", "rank 1 passed 9")
    assert both(loaded, "load-good") == [{"ok": {"rng": True}}] * 2
    assert both(loaded, "load-latest") == [{"ok": {"rng": True}}] * 2
    for calls in both(loaded, "load-collectives") + both(loaded, "load-latest-collectives"):
        assert calls == ["all_gather_object"], calls  # one round trip, with or without a step
    refused(loaded, "mixed", "call: rank 0 called load, rank 1 called save")
    assert loaded[1][0]["steps"] == loaded[1][1]["steps"] == [9]

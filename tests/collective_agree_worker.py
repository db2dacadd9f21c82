"""Run by tests/test_collective_agreement.py as one rank of a gloo group of 2 (issue 27, items 8 and 9):

    python collective_agree_worker.py save|load REPO PORT RANK OUT

Every scenario of a kind runs in this one group (starting torch for each would cost more than the scenarios); each rank
writes what it saw to OUT as JSON: per scenario, "ok" plus what it checked, or the error's type and message.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import luopan


def _tensor(value: float, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + value


def _outcome(call) -> dict:  # noqa: ANN001
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return {"error": type(exc).__name__, "collective": isinstance(exc, luopan.CollectiveError),
                "message": str(exc)}
    return {"ok": result}


class _Counter:
    """Counts this process's calls of torch.distributed's collectives (to bound what a save or load costs)."""

    NAMES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "all_gather",
             "broadcast", "all_reduce", "barrier", "gather", "scatter", "all_to_all")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self) -> _Counter:
        for name, fn in self.saved.items():
            def counted(*a, _fn=fn, _name=name, **k):  # noqa: ANN002, ANN003, ANN202
                self.calls.append(_name)
                return _fn(*a, **k)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def scenarios(repo: luopan.Repo, rank: int) -> dict:
    out: dict = {}
    shared = _tensor(100.0)  # equal on both ranks (a replicated tensor)

    # item 8: rank 0 ties "a" and "b"; rank 1 holds two distinct tensors there (a per rank)
    own_a, own_b = _tensor(10.0 * rank), _tensor(10.0 * rank + 5)
    mine = {"a": own_a, "b": own_a if rank == 0 else own_b, "step": 1}
    out["tie0-save"] = _outcome(lambda: repo.save("tie0", 1, mine, group=True).step)

    def check_tie0() -> dict:
        got = repo.load("tie0", 1, group=True)
        want_b = own_a if rank == 0 else own_b
        return {"a": torch.equal(got["a"], own_a), "b": torch.equal(got["b"], want_b),
                "tied": got["a"] is got["b"]}
    out["tie0-load"] = _outcome(check_tie0)

    def check_tie0_into() -> dict:
        a, b = torch.zeros(6), torch.zeros(6)
        repo.load_into("tie0", {"a": a, "b": b, "step": 0}, 1, group=True)
        return {"a": torch.equal(a, own_a), "b": torch.equal(b, own_a if rank == 0 else own_b)}
    out["tie0-load-into"] = _outcome(check_tie0_into)

    # item 8, the other way round, and with the tied tensor replicated: rank 1 ties "b" to the replicated "a"
    a, other = shared.clone(), _tensor(7.0)
    mine = {"a": a, "b": other if rank == 0 else a, "c": _tensor(-1.0)}
    out["tie1-save"] = _outcome(lambda: repo.save("tie1", 1, mine, group=True).step)

    def check_tie1() -> dict:
        got = repo.load("tie1", 1, group=True)
        want_b = other if rank == 0 else shared
        return {"a": torch.equal(got["a"], shared), "b": torch.equal(got["b"], want_b),
                "c": torch.equal(got["c"], _tensor(-1.0)), "tied": got["a"] is got["b"]}
    out["tie1-load"] = _outcome(check_tie1)

    # item 9: run names, steps, overwrite and structure that differ between the ranks
    state = {"w": shared, "rng": _tensor(float(rank))}
    out["run"] = _outcome(lambda: repo.save("agree-a" if rank == 0 else "agree-b", 1, state, group=True).step)
    out["step"] = _outcome(lambda: repo.save("agree", 5 + rank, state, group=True).step)
    extra = {**state, "extra": _tensor(1.0)} if rank == 1 else state
    out["keys"] = _outcome(lambda: repo.save("agree", 7, extra, group=True).step)
    value = {**state, "lr": 0.1 * (rank + 1)}
    out["value"] = _outcome(lambda: repo.save("agree", 8, value, group=True).step)
    # a good save in the same group afterwards, counting its collectives (one round trip per phase, no more)
    with _Counter() as counted:
        out["good"] = _outcome(lambda: repo.save("agree", 9, state, group=True).step)
    out["save-collectives"] = counted.calls
    out["overwrite"] = _outcome(lambda: repo.save("agree", 9, state, group=True, overwrite=rank == 0).step)
    out["steps"] = {run: repo.steps(run) for run in ("agree", "agree-a", "agree-b", "tie0", "tie1")}
    return out


def load_scenarios(repo: luopan.Repo, rank: int) -> dict:
    """Collective loads of what ``scenarios`` saved: every rank must ask for the same run and step."""
    out: dict = {}
    state = {"w": _tensor(100.0), "rng": _tensor(float(rank))}

    def load(run: str, step: int | None) -> dict:
        got = repo.load(run, step, group=True)
        return {"rng": torch.equal(got["rng"], state["rng"])}
    out["load-run"] = _outcome(lambda: load("agree" if rank == 0 else "tie0", 9))
    out["load-step"] = _outcome(lambda: load("agree", 9 if rank == 0 else None))
    out["load-into-step"] = _outcome(lambda: repo.load_into("agree", {"w": torch.zeros(6), "rng": torch.zeros(6)},
                                                            9 if rank == 1 else 1, group=True) and True)
    # a rank that loads while the other saves: both refused, nothing committed
    out["mixed"] = _outcome(lambda: load("agree", 9) if rank == 0 else repo.save("agree", 10, state, group=True).step)
    out["steps"] = repo.steps("agree")
    with _Counter() as counted:
        out["load-good"] = _outcome(lambda: load("agree", 9))
    out["load-collectives"] = counted.calls
    with _Counter() as counted:
        out["load-latest"] = _outcome(lambda: load("agree", None))
    out["load-latest-collectives"] = counted.calls
    return out


def main() -> None:
    op, repo_path, port, rank, out_path = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        with luopan.open(repo_path) as repo:
            result = (scenarios if op == "save" else load_scenarios)(repo, rank)
        with open(out_path, "w") as f:
            json.dump(result, f)
        dist.barrier()  # both done before either tears the group down
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's threads sometimes abort


if __name__ == "__main__":
    main()

"""Run by tests/test_collective.py in several processes (torch.distributed, gloo): collective saves and loads.

    python collective_worker.py save|load|save-die|save-shards|load-shards|load-shards-world REPO WORLD PORT STEP [RANK]

Without RANK the ranks are spawned here (torch.multiprocessing, which stops them all when one dies); with RANK this
process is that one rank (the kill test starts each rank itself, to see the survivors' errors).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import luopan


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)  # the same on every rank: replicated, as DDP keeps it
    model = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    return {"model": model, "rng": torch.full((8,), float(rank * 100 + step)),  # differs per rank
            "step": step, "tied": model["w"],
            "kind": torch.zeros(2, dtype=torch.int32 if rank == 0 else torch.float32)}  # equal bytes, other dtypes


def full_sharded(step: int, world: int) -> dict:
    """The global tensors of ``sharded_state``: what one process loads back from its collective save."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"emb": torch.randn(128 * world + 3, 64, generator=g),  # rows split unevenly between the ranks
            "col": torch.randn(16, 8 * world, generator=g),  # columns split: each shard is not one run of bytes
            "bias": torch.randn(64, generator=g),  # replicated, a plain tensor
            "dt": torch.randn(2 * world + 1, 24, generator=g),  # a DTensor sharded by rows (uneven)
            "dt_rep": torch.randn(16, generator=g),  # a DTensor replicated on every rank: stored once
            "tiny": torch.randn(1, 5, generator=g),  # a DTensor of one row: rank 1's shard is empty
            "st": torch.randn(4 * world, 8, generator=g),  # a (legacy) ShardedTensor
            "step": step}


def sharded_state(rank: int, world: int, step: int, mesh: object = None) -> dict:
    """Rank ``rank``'s state: declared luopan.Shard row and column shards, a replicated tensor, a per-rank RNG state,
    and (with ``mesh``) DTensors."""
    full = full_sharded(step, world)
    rows = torch.tensor_split(torch.arange(full["emb"].shape[0]), world)[rank]
    emb = luopan.Shard(full["emb"][int(rows[0]):int(rows[-1]) + 1].clone(), full["emb"].shape, (int(rows[0]), 0))
    col = luopan.Shard(full["col"][:, 8 * rank:8 * rank + 8].clone(), tuple(full["col"].shape), [0, 8 * rank])
    out = {"emb": emb, "col": col, "bias": full["bias"], "rng": torch.full((4,), float(rank * 10 + step)),
           "step": step, "tied": emb}
    if mesh is not None:
        from torch.distributed._shard.sharded_tensor import Shard as LocalShard
        from torch.distributed._shard.sharded_tensor import (
            ShardMetadata,
            init_from_local_shards,
        )
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        out["dt"] = distribute_tensor(full["dt"], mesh, [Shard(0)])
        out["dt_rep"] = distribute_tensor(full["dt_rep"], mesh, [Replicate()])
        out["tiny"] = distribute_tensor(full["tiny"], mesh, [Shard(0)])
        mine = LocalShard(full["st"][4 * rank:4 * rank + 4].clone(),
                          ShardMetadata([4 * rank, 0], [4, 8], f"rank:{rank}/cpu"))
        out["st"] = init_from_local_shards([mine], 4 * world, 8)
    return out


def local_values(state: dict) -> dict:
    """This rank's local tensors of a ``sharded_state`` (what ``load(..., group=...)`` returns)."""
    def local(v: object) -> object:
        if isinstance(v, luopan.Shard):
            return v.tensor
        if hasattr(v, "local_shards"):
            return v.local_shards()[0].tensor
        return v.to_local() if hasattr(v, "to_local") else v
    return {k: local(v) for k, v in state.items()}


def _bad_shard_saves(repo: luopan.Repo, rank: int, step: int) -> None:
    """Shards that disagree between ranks are refused on every rank, before anything is written."""
    clash = {"x": luopan.Shard(torch.full((2, 4), float(rank)), (4, 4), (0, 0))}  # same place, other bytes
    gap = {"x": luopan.Shard(torch.ones(1, 4), (4, 4), (rank, 0))}  # 2 of 4 rows
    for bad, message in ((clash, "differ between ranks"), (gap, "do not tile")):
        try:
            repo.save("run", step + 100, bad, group=True)
        except luopan.CollectiveError as exc:
            assert message in str(exc) and "nothing was committed" in str(exc), exc
        else:
            raise AssertionError(f"a bad sharded save was not refused ({message})")


def _load_shards(repo: luopan.Repo, rank: int, world: int, step: int, mesh: object) -> None:
    from luopan.checkpoint.distributed import load as collectiveload

    read: list[str] = []
    entry_jobs = collectiveload.entry_jobs

    def counted(store: object, m: object, i: int, dest: memoryview, sizes: object = None) -> list:
        read.append(m.entries[i]["path"])
        return entry_jobs(store, m, i, dest, sizes)

    collectiveload.entry_jobs = counted
    got = repo.load("run", step, group=True)
    collectiveload.entry_jobs = entry_jobs
    want = local_values(sharded_state(rank, world, step, mesh))
    for k in ("emb", "col", "bias", "dt", "dt_rep", "tiny", "st", "rng"):
        assert type(got[k]) is torch.Tensor and torch.equal(got[k], want[k]), k
    assert got["tied"] is got["emb"] and got["step"] == step
    m = repo.manifest("run", step)
    shards = {m.entries[c[2]]["path"]: rank in c[3] for rec in m.doc["ranks"]["sharded"].values()
              for c in rec["chunks"]}
    mine = {p for p, held in shards.items() if held} | {"bias", f"rng/rank-{rank}"}
    assert sorted(read) == sorted(mine), (read, mine)  # only this rank's chunks, each once
    # load_into a target of the same layout (DTensors and declared shards), zeroed first
    target = sharded_state(rank, world, step, mesh)
    with torch.no_grad():
        for v in local_values(target).values():
            if isinstance(v, torch.Tensor):
                v.zero_()
    assert repo.load_into("run", target, step, group=True) is target
    for k, v in local_values(target).items():
        assert k == "step" or torch.equal(v, want[k]), k
    plain = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    plain["tied"] = plain["emb"]
    repo.load_into("run", plain, step, group=True)
    assert all(torch.equal(plain[k], want[k]) for k in ("emb", "col", "dt", "rng"))


def run(rank: int, world: int, op: str, repo_path: str, port: str, step: int) -> None:
    _run(rank, world, op, repo_path, port, step)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done: skip interpreter teardown, where gloo's threads sometimes abort ("terminate called …")


def _run(rank: int, world: int, op: str, repo_path: str, port: str, step: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    try:
        repo = luopan.open(repo_path)
        if op == "save":
            info = repo.save("run", step, state(rank, step), group=True, metrics={"loss": 1.0})
            if rank == 0:
                with open(os.path.join(repo_path, "..", "info.json"), "w") as f:
                    json.dump({"new_bytes": info.new_bytes, "logical": info.logical_bytes}, f)
        elif op == "load":
            got = repo.load("run", step, group=True)
            want = state(rank, step)
            assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["rng"], want["rng"])
            assert got["tied"] is got["model"]["w"] or torch.equal(got["tied"], got["model"]["w"])
            assert got["step"] == step
        elif op == "save-shards":
            mesh = init_device_mesh("cpu", (world,))
            _bad_shard_saves(repo, rank, step)
            info = repo.save("run", step, sharded_state(rank, world, step, mesh), group=True)
            if rank == 0:
                with open(os.path.join(repo_path, "..", "info.json"), "w") as f:
                    json.dump({"new_bytes": info.new_bytes, "logical": info.logical_bytes}, f)
        elif op == "load-shards":
            _load_shards(repo, rank, world, step, init_device_mesh("cpu", (world,)))
        elif op == "load-shards-world":  # a group of another size than the one that saved
            try:
                repo.load("run", step, group=True)
            except luopan.LayoutMismatchError as exc:
                assert "resharding on load is luopan.dcp's job" in str(exc), exc
            else:
                raise AssertionError("a sharded checkpoint loaded at another world size")
        elif op == "save-die":
            if rank == world - 1:
                original = repo.checkpointing.store_entries

                def die(tensors):  # noqa: ANN001, ANN202
                    os.kill(os.getpid(), signal.SIGKILL)
                    return original(tensors)

                repo.checkpointing.store_entries = die
            try:
                repo.save("run", step, state(rank, step), group=True)
            except luopan.CollectiveError as exc:
                print(f"rank {rank}: {exc}", file=sys.stderr)
                sys.exit(17)  # the survivors' clear error
        repo.close()
        if op != "save-die":
            dist.barrier()  # every rank done before any tears the group down (gloo aborts on an early teardown)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group after a dead rank
            pass


def main() -> None:
    op, repo, world, port, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    if len(sys.argv) > 6:
        run(int(sys.argv[6]), world, op, repo, port, step)
    else:
        mp.spawn(run, args=(world, op, repo, port, step), nprocs=world, join=True)


if __name__ == "__main__":
    main()

"""Run by tests/test_collective.py in several processes (torch.distributed, gloo): collective saves and loads.

    python collective_worker.py save|load|save-die REPO WORLD PORT STEP [RANK]

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

import luopan


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)  # the same on every rank: replicated, as DDP keeps it
    model = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    return {"model": model, "rng": torch.full((8,), float(rank * 100 + step)),  # differs per rank
            "step": step, "tied": model["w"],
            "kind": torch.zeros(2, dtype=torch.int32 if rank == 0 else torch.float32)}  # equal bytes, other dtypes


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
        elif op == "save-die":
            if rank == world - 1:
                original = repo.store_entries

                def die(tensors):  # noqa: ANN001, ANN202
                    os.kill(os.getpid(), signal.SIGKILL)
                    return original(tensors)

                repo.store_entries = die
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

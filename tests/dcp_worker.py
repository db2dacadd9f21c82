"""Run by tests/test_dcp.py in several processes (torch.distributed, gloo, CPU): DCP saves and loads through
luopan.dcp with sharded (DTensor) and replicated (DDP-like) state.

    python dcp_worker.py save-sharded|save-sharded-fs|load-sharded|save-replicated|save-die REPO WORLD PORT STEP
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import luopan.dcp

ROWS, COLS = 64, 32


def full_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"emb": torch.randn(ROWS, COLS, generator=g), "proj": torch.randn(COLS, 16, generator=g),
            "bias": torch.arange(16, dtype=torch.float64) * step}


def column_tensor(step: int) -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + step


def run(rank: int, world: int, op: str, repo: str, port: str, step: int) -> None:
    _run(rank, world, op, repo, port, step)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done: skip interpreter teardown, where gloo's threads sometimes abort ("terminate called …")


def _run(rank: int, world: int, op: str, repo: str, port: str, step: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        full = full_state(step)
        if op in ("save-sharded", "load-sharded", "save-die", "save-sharded-fs"):
            mesh = init_device_mesh("cpu", (world,))
            if op == "load-sharded":
                target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}
                target["meta"] = {"step": -1}
                dcp.load(target, storage_reader=luopan.dcp.Reader(repo, "run"))
                for k, v in full.items():
                    assert torch.equal(target[k].full_tensor(), v), k
                assert target["meta"] == {"step": step}, target["meta"]
                dist.barrier()
                return
            state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
            state["meta"] = {"step": step}
            if op == "save-sharded-fs":  # with a column-sharded tensor, into luopan and into DCP's own files
                state["col"] = distribute_tensor(column_tensor(step), mesh, [Shard(1)])
                dcp.save(state, storage_writer=dcp.FileSystemWriter(repo + "-fs"))
            if op == "save-die" and rank == 1:
                writer = luopan.dcp.Writer(repo, "run", step)
                original = writer.write_data

                def die(plan, planner):  # noqa: ANN001, ANN202
                    os.kill(os.getpid(), signal.SIGKILL)
                    return original(plan, planner)

                writer.write_data = die
                dcp.save(state, storage_writer=writer)
                return
            dcp.save(state, storage_writer=luopan.dcp.Writer(repo, "run", step))
        elif op == "save-replicated":  # every rank holds the whole state, as DDP does: DCP writes each item once
            dcp.save(dict(full), storage_writer=luopan.dcp.Writer(repo, "ddp", step))
        dist.barrier()  # every rank done before any tears the group down (gloo aborts on an early teardown)
    finally:
        dist.destroy_process_group()


def main() -> None:
    op, repo, world, port, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    mp.spawn(run, args=(world, op, repo, port, step), nprocs=world, join=True)


if __name__ == "__main__":
    main()

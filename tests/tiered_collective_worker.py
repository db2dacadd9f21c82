"""Run by tests/test_scale_ranks.py: one rank of a gloo group whose ranks each stand for a node, with a local tier of
its own (BASE/node<rank>) replicating to one S3 URL.

    python tiered_collective_worker.py save-load|save-die|load BASE URL WORLD PORT STEPS RANK

save-load saves steps 1..STEPS collectively (counting the object store's LIST requests of each), then loads the last
back on every rank and checks it bit-exact; save-die saves STEPS with the last rank killed (SIGKILL) once its part is
on the remote; load loads STEPS on every rank. Each rank writes what it saw to BASE/<op>-rank<rank>.json.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import luopan

ROWS = 64  # rows of this rank's shard; COLS fp32 columns (1 KiB a row)
COLS = 256


def state(rank: int, world: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)  # the same on every rank: replicated, as DDP keeps a model
    model = {"w": torch.randn(128, COLS, generator=g), "b": torch.randn(COLS, generator=g)}
    mine = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(100 * step + rank))
    return {"model": model, "emb": luopan.Shard(mine, (ROWS * world, COLS), (ROWS * rank, 0)),
            "rng": torch.full((8,), float(rank * 100 + step)), "step": step}


def replicated_bytes(world: int) -> int:
    """The state's bytes with replicated tensors once: model, every shard, every rank's RNG tensor."""
    return (128 * COLS + COLS) * 4 + world * (ROWS * COLS * 4 + 8 * 4)


def check(got: dict, want: dict) -> None:
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["emb"], want["emb"].tensor) and torch.equal(got["rng"], want["rng"])
    assert got["step"] == want["step"]


def count_lists() -> dict:
    """Count list requests s3fs sends (list_objects_v2 and the like), in this process."""
    import s3fs

    seen = {"lists": 0}
    call = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):  # noqa: ANN001, ANN202
        if str(getattr(method, "__name__", method)).startswith("list"):
            seen["lists"] += 1
        return await call(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted
    return seen


def main() -> None:
    op, base, url = sys.argv[1], sys.argv[2], sys.argv[3]
    world, port, steps, rank = int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    out: dict = {"rank": rank}
    local = os.path.join(base, f"node{rank}")
    if rank == 0:  # the first open of an empty remote creates the repository there; the other nodes adopt it
        repo = luopan.open(local, replicate_to=url, compression="none")
    dist.barrier()
    if rank:
        repo = luopan.open(local, replicate_to=url)
    if op == "save-load":
        seen = count_lists()
        out["lists"], out["new_bytes"] = [], []
        for step in range(1, steps + 1):
            before = seen["lists"]
            info = repo.save("run", step, state(rank, world, step), group=True)
            out["lists"].append(seen["lists"] - before)
            out["new_bytes"].append(info.new_bytes)
        check(repo.load("run", steps, group=True), state(rank, world, steps))
    elif op == "load":
        check(repo.load("run", steps, group=True), state(rank, world, steps))
        out["steps"] = repo.steps("run")
    elif op == "save-die":
        if rank == world - 1:
            publish = repo.tier.publish

            def die(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                publish(*args, **kwargs)  # its packs and index file are on the remote: only the manifest is missing
                os.kill(os.getpid(), signal.SIGKILL)

            repo.tier.publish = die
        try:
            repo.save("run", steps, state(rank, world, steps), group=True)
        except luopan.CollectiveError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            with open(os.path.join(base, f"{op}-rank{rank}.json"), "w") as f:
                json.dump(out, f)
            sys.stdout.flush()
            os._exit(17)
    with open(os.path.join(base, f"{op}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    repo.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's threads sometimes abort


if __name__ == "__main__":
    main()

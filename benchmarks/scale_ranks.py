"""The `scale` suite's many-ranks part (issue 30): collective saves and loads with 2 to 16 processes, each standing
for a node with a local directory of its own (its local tier), all replicating to one loopback S3 server.

Each world size is one `torch.multiprocessing.spawn` of gloo ranks on 127.0.0.1. Rank 0 opens its repository first
(creating the remote repository), then the others open theirs (each adopts the remote's config, docs/format.md
§10.2). Every rank holds the same replicated tensors (a DDP model, REPLICATED_MIB) plus its own row shard of a
sharded tensor (`luopan.Shard`, SHARD_MIB) and a per-rank RNG tensor. STEPS saves: the first writes everything,
each later one changes one replicated tensor's first chunk and the first chunk of every rank's shard (~3-6 %).

Requests are counted at the server (a WSGI wrapper around moto's app, queried and reset over HTTP between saves),
never by instrumenting luopan: PUT (object puts and multipart parts), POST (multipart start/complete), GET (object
reads, ranged or not), HEAD, LIST (a GET on the bucket: list-objects), DELETE.

Times at rank 0: `save` is the whole `repo.save(..., group=...)`; `commit` is rank 0's commit phase, from the
moment every rank's part is reported (rank 0 enters `commit_entries`) to the save returning: the manifest written
locally, copied to the remote after every pack it names is verified there, and every rank told.

* SC6.rank0_commit_growth_16_over_2: median steady-state commit time at the largest world / at 2 ranks (linear
  growth would be 8 from 2 to 16 ranks). Goal <= 8 (--quick: 8 over 2 ranks, goal <= 4, the same id).
* SC7.lists_per_save: the most LISTs the server saw during one collective save, over every world size and step.
  Goal <= 1.
* SC8.replicated_bytes_over_state: chunk bytes written in all by the first save (every rank's new chunks) / the
  unique state bytes (replicated tensors once, every shard, every rank's RNG tensor), at the largest world. Goal <=
  1.05.

    python benchmarks/scale_ranks.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import median  # noqa: E402
from tiers import S3Server  # noqa: E402

WORLDS = (2, 4, 8, 16)
WORLDS_QUICK = (2, 4, 8)
STEPS, STEPS_QUICK = 4, 3
REPLICATED_MIB, SHARD_MIB = 2.0, 1.0  # per rank: a few MiB, so 16 ranks and moto share 2 cores within budget
QUICK_MIB = 0.5  # both, --quick
CHUNK = 64 << 10  # a chunk of the benchmark repositories: a few % of the state changes per step
COLS = 256  # fp32 columns of every tensor: one row is 1 KiB
N_REPLICATED = 16
GLOO_TIMEOUT_S = 300

# moto's server (as tiers.SERVER) behind a counter of requests by S3 operation; GET /__counts__ returns the counts
# since the last reset (and resets them with ?reset=1).
COUNTING_SERVER = r"""
import json, sys, threading
from urllib.parse import parse_qs
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

app = DomainDispatcherApplication(create_backend_app)
lock = threading.Lock()
counts = {}

def operation(environ):
    method = environ["REQUEST_METHOD"]
    bucket, _, key = environ.get("PATH_INFO", "/").lstrip("/").partition("/")
    query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    if method == "GET" and not key:
        return "LIST"
    if method == "POST" and "delete" in query:
        return "DELETE"
    return method

def counting(environ, start_response):
    if environ.get("PATH_INFO") == "/__counts__":
        with lock:
            body = json.dumps(counts).encode()
            if "reset=1" in environ.get("QUERY_STRING", ""):
                counts.clear()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    op = operation(environ)
    size = int(environ.get("CONTENT_LENGTH") or 0) if op == "PUT" else 0
    with lock:
        counts[op] = counts.get(op, 0) + 1
        if size:
            key = "put_bytes_packs" if "/packs/" in environ.get("PATH_INFO", "") else "put_bytes_other"
            counts[key] = counts.get(key, 0) + size
    return app(environ, start_response)

server = make_server("127.0.0.1", 0, counting, threaded=True, request_handler=MotoRequestHandler)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
server.shutdown()
"""
OPS = ("PUT", "POST", "GET", "HEAD", "LIST", "DELETE")


class CountingS3Server(S3Server):
    """tiers.S3Server, counting requests by S3 operation at the server."""

    script = COUNTING_SERVER

    def counts(self, reset: bool = False) -> dict[str, int]:
        return counts_at(self.endpoint, reset)


def counts_at(endpoint: str, reset: bool = False) -> dict[str, int]:
    with urllib.request.urlopen(f"{endpoint}/__counts__{'?reset=1' if reset else ''}", timeout=30) as r:
        return json.loads(r.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_state(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank``'s state: replicated tensors (the same on every rank), its row shard, its RNG tensor."""
    import torch

    import luopan

    g = torch.Generator().manual_seed(7)  # the same on every rank: replicated, as DDP keeps a model
    rows = max(1, int(cfg["replicated_mib"] * 1024) // N_REPLICATED)
    model = {f"layer{i}": torch.randn(rows, COLS, generator=g) for i in range(N_REPLICATED)}
    shard_rows = max(1, int(cfg["shard_mib"] * 1024))
    mine = torch.randn(shard_rows, COLS, generator=torch.Generator().manual_seed(1000 + rank))
    emb = luopan.Shard(mine, (shard_rows * world, COLS), (shard_rows * rank, 0))
    return {"model": model, "emb": emb, "rng": torch.full((8,), float(rank)), "step": 0}


def unique_bytes(state: dict[str, Any], world: int) -> int:
    """The bytes of the state the whole group holds, replicated tensors once."""
    return (sum(t.nbytes for t in state["model"].values()) + world * state["emb"].tensor.nbytes
            + world * state["rng"].nbytes)


def advance(state: dict[str, Any], step: int) -> None:
    """One training step's change: the first chunk of one replicated tensor and of this rank's shard."""
    rows = CHUNK // (4 * COLS)
    state["model"][f"layer{step % N_REPLICATED}"][:rows] += 1.0
    state["emb"].tensor[:rows] += 1.0
    state["rng"] += 1.0
    state["step"] = step


def pack_bytes(root: str) -> int:
    total = 0
    for d, _sub, files in os.walk(os.path.join(root, "packs")):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    try:
        _work(rank, world, port, cfg)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # gloo's threads sometimes abort in interpreter teardown


def _work(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import luopan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    local = os.path.join(cfg["work"], f"world{world}", f"node{rank}")
    opts = {"replicate_to": cfg["url"], "chunk_size": CHUNK}
    if rank == 0:  # creates the remote repository; every other rank's new local tier adopts it
        repo = luopan.open(local, **opts)
    dist.barrier()
    if rank:
        repo = luopan.open(local, **opts)
    cp = repo.checkpointing
    marks: dict[str, float] = {}
    parts: list[dict[str, int]] = []
    store_entries, commit_entries = cp.store_entries, cp.commit_entries

    def stored(tensors: Any) -> Any:
        out = store_entries(tensors)
        parts.append(dict(out.written))
        return out

    def commit(*a: Any, **k: Any) -> Any:
        marks["commit"] = time.perf_counter()
        return commit_entries(*a, **k)

    cp.store_entries, cp.commit_entries = stored, commit
    state = build_state(rank, world, cfg)
    rows = []
    for step in range(1, cfg["steps"] + 1):
        if step > 1:
            advance(state, step)
        before = pack_bytes(local)
        parts.clear()
        dist.barrier()
        if rank == 0:
            counts_at(cfg["endpoint"], reset=True)
        dist.barrier()
        t0 = time.perf_counter()
        repo.save("run", step, state, group=True)
        t1 = time.perf_counter()
        dist.barrier()
        row = {"step": step, "save_s": t1 - t0, "pack_bytes": pack_bytes(local) - before,
               "new_bytes": sum(p.get("new_bytes", 0) for p in parts),
               "stored_bytes": sum(p.get("stored_bytes", 0) for p in parts)}
        if rank == 0:
            row["commit_s"] = t1 - marks["commit"]
            row["requests"] = counts_at(cfg["endpoint"])
        rows.append(row)
    # every rank loads the last checkpoint back, bit-exact, reading other ranks' packs from the remote
    t0 = time.perf_counter()
    got = repo.load("run", cfg["steps"], group=True)
    load_s = time.perf_counter() - t0
    exact = (all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
             and torch.equal(got["emb"], state["emb"].tensor) and torch.equal(got["rng"], state["rng"]))
    out = {"rank": rank, "rows": rows, "load_s": load_s, "exact": bool(exact),
           "unique_bytes": unique_bytes(state, world) if rank == 0 else None}
    with open(os.path.join(cfg["work"], f"world{world}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    repo.close()
    dist.barrier()
    dist.destroy_process_group()


def measure_world(world: int, s3: CountingS3Server, work: str, quick: bool, log: Any) -> dict[str, Any]:
    import torch.multiprocessing as mp

    mib = QUICK_MIB if quick else None
    cfg = {"work": work, "url": s3.fresh_url(), "endpoint": s3.endpoint, "steps": STEPS_QUICK if quick else STEPS,
           "replicated_mib": mib or REPLICATED_MIB, "shard_mib": mib or SHARD_MIB}
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(world, free_port(), cfg), nprocs=world, join=True)
    ranks = []
    for r in range(world):
        with open(os.path.join(work, f"world{world}-rank{r}.json")) as f:
            ranks.append(json.load(f))
    r0 = ranks[0]["rows"]
    steady = r0[1:]  # the first save writes everything
    requests = [row["requests"] for row in steady]
    per_op = {op: median([float(q.get(op, 0)) for q in requests]) for op in OPS}
    first_new = sum(rk["rows"][0]["new_bytes"] for rk in ranks)
    first_packs = [rk["rows"][0]["pack_bytes"] for rk in ranks]
    out = {
        "world": world,
        "commit_s": median([row["commit_s"] for row in steady]),
        "save_s": median([row["save_s"] for row in steady]),
        "first_save_s": r0[0]["save_s"], "first_commit_s": r0[0]["commit_s"],
        "load_s": max(rk["load_s"] for rk in ranks),
        "requests_per_save": per_op,
        "requests_first_save": {op: r0[0]["requests"].get(op, 0) for op in OPS},
        "lists_max": max(int(row["requests"].get("LIST", 0)) for row in r0),
        "put_bytes_steady": median([float(q.get("put_bytes_packs", 0)) for q in requests]),
        "put_bytes_first": r0[0]["requests"].get("put_bytes_packs", 0),
        "first_new_bytes": first_new, "unique_bytes": ranks[0]["unique_bytes"],
        "first_pack_bytes_per_rank": first_packs, "first_pack_bytes_total": sum(first_packs),
        "steady_new_bytes_per_rank": [median([float(row["new_bytes"]) for row in rk["rows"][1:]]) for rk in ranks],
        "all_exact": all(rk["exact"] for rk in ranks),
        "wall_s": time.perf_counter() - t0,
    }
    log(f"world {world:2d}: commit {out['commit_s']:.3f} s, save {out['save_s']:.3f} s, per save "
        + ", ".join(f"{op} {per_op[op]:.0f}" for op in OPS)
        + f"; first save {first_new / 2**20:.2f} MiB new of {out['unique_bytes'] / 2**20:.2f} MiB unique; "
        f"loads exact: {out['all_exact']} ({out['wall_s']:.0f} s)")
    return out


def run_ranks(quick: bool, workdir: str, log: Any) -> list[dict[str, Any]]:
    """The SC6-SC8 results plus one context row per world size (see the module docstring)."""
    work = tempfile.mkdtemp(prefix="scale-ranks-", dir=workdir)
    worlds = WORLDS_QUICK if quick else WORLDS
    try:
        with CountingS3Server() as s3:
            per_world = [measure_world(w, s3, work, quick, log) for w in worlds]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    small, big = per_world[0], per_world[-1]
    growth = big["commit_s"] / small["commit_s"] if small["commit_s"] else None
    linear = big["world"] / small["world"]
    lists = max(w["lists_max"] for w in per_world)
    over = big["first_new_bytes"] / big["unique_bytes"]
    common = {"worlds": list(worlds), "quick": quick, "all_loads_exact": all(w["all_exact"] for w in per_world)}
    results = [
        {"id": "SC6.rank0_commit_growth_16_over_2", "value": growth, "ratio": growth, "goal": linear, "goal_op": "<=",
         "met": growth is not None and growth <= linear,
         "over_worlds": [small["world"], big["world"]],  # --quick: 8 over 2, its goal linear over that range (4)
         "commit_s": {w["world"]: w["commit_s"] for w in per_world},
         "save_s": {w["world"]: w["save_s"] for w in per_world},
         "save_growth": big["save_s"] / small["save_s"],
         "commit_means": "rank 0, from entering commit_entries (every part reported) to the save returning; median "
                         "of the steady-state saves", **common},
        {"id": "SC7.lists_per_save", "value": lists, "ratio": lists, "goal": 1, "goal_op": "<=", "met": lists <= 1,
         "lists_per_save": {w["world"]: w["requests_per_save"]["LIST"] for w in per_world}, **common},
        {"id": "SC8.replicated_bytes_over_state", "value": over, "ratio": over, "goal": 1.05, "goal_op": "<=",
         "met": over <= 1.05, "world": big["world"], "first_new_bytes": big["first_new_bytes"],
         "unique_bytes": big["unique_bytes"], "pack_bytes_total": big["first_pack_bytes_total"], **common},
    ]
    for w in per_world:
        results.append({"id": f"SC.ranks_context_world_{w['world']}", "value": w["commit_s"], **w})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    results = run_ranks(args.quick, args.workdir or tempfile.gettempdir(), lambda m: print(m, flush=True))
    for r in results:
        if "goal" in r:
            print(f"{r['id']}: {r['value']:.3f} (goal {r['goal_op']} {r['goal']}) {'met' if r['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""The `dist` suite: PyTorch Distributed Checkpoint (DCP) saves at world size 2 through `luopan.dcp.Writer` against
DCP's own `FileSystemWriter`.

Two worker processes (torch.multiprocessing.spawn) form a gloo process group on 127.0.0.1 (a free port) and stay up
for the whole suite; rank 0 measures and writes its results to a JSON file the parent reads.

D1.dcp_first_save_vs_filesystem: `dcp.save` of a `--size-mib` fp32 state (1 GiB; --quick 256 MiB), every tensor a
DTensor `Shard(0)` on `init_device_mesh("cpu", (2,))` (each rank generates and holds only its rows, so every item
DCP writes is unique to one rank), with `FileSystemWriter(new dir)` (defaults: `sync_files=True`, fsync) / with
`luopan.dcp.Writer(fresh repository, run, 0)` (luopan fsyncs). Goal >= 1.0.

D2.dcp_resave_vs_filesystem: one "training step" later: a fixed set of whole tensors totalling about 1% of the state
(a seeded choice: whole tensors closest to 1% of the bytes; the exact fraction is in the JSON) gets an update
(`add_` of small noise to every element), then the second save: `FileSystemWriter` into a new directory (it writes
everything again) / `luopan.dcp.Writer(..., trust_versions=True)` into the same repository at step 1 (both luopan
saves pass trust_versions=True: tensors whose version counter did not move reuse their chunks unread, the changed
ones are hashed and only their changed chunks written). Goal >= 10. Context (not goals): the same re-save without
trust_versions (`hashing`: every byte hashed, another training step later, at step 2); and (one sample) the re-save
after 1% of the rows of *every* tensor changed at scattered positions, where chunk deduplication cannot help
(luopan.dcp stores no row deltas).

D3.ddp_bytes_over_state: a DDP-style state (both ranks hold the same full tensors, replicated) saved by both ranks
through `luopan.dcp.Writer` (DCP's planner gives each replicated item to one rank): bytes of the pack files under
<repo>/packs / state bytes. Goal <= 1.05. FileSystemWriter's bytes and both save times are context (one sample).

Method (as the other suites): each repetition alternates peer and luopan (the order flips every repetition) and
reports medians; the first repetition is a warm-up, not counted, that also loads both sides' re-saves back (DCP
load, resharded into zero-filled DTensors) and checks them against the state. A save is timed on rank 0 from a
barrier before `dcp.save` to a barrier after it (`sync` and a GC collection first, the cyclic GC paused during).
Every first save goes to a fresh directory / a fresh repository (the `luopan.open` that creates it is untimed);
outputs are removed and `sync` is called between measurements (untimed).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import socket
import sys
import tempfile
import time
import warnings
from typing import Any

from artifacts import dir_bytes
from common import fmt as _fmt
from common import print_footer, print_tables
from common import ratio_result as _ratio_result
from common import (
    MIB,
    loadavg,
    machine_info,
    median,
    quiet_gc,
    ratio,
    remove,
    settle,
)
from foundation import build_state, state_layout

WORLD = 2
RUN = "bench"
DDP_RUN = "ddp"
CHANGED_FRACTION = 0.01  # D2: the share of the state's bytes one training step changes
TRAINABLE_SEED = 7  # which tensors are "trainable" (D2)
TIMEOUT_S = 900  # gloo collective timeout: a rank that dies makes the other fail within this


# -- the state -------------------------------------------------------------------------------------------------


def rows_of(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, end) of dimension 0 that `rank` holds under Shard(0) (torch.chunk: ceil-sized pieces)."""
    c = -(-n // world)
    start = min(rank * c, n)
    return start, min(start + c, n)


def trainable_names(layout: list[tuple[str, tuple[int, ...]]], fraction: float = CHANGED_FRACTION) -> list[str]:
    """Whole tensors whose bytes total as close to `fraction` of the state as a seeded greedy choice gets: first
    every tensor (in a seeded order) that still fits under the target, then, if that left a gap, the one more tensor
    that brings the total closest to it."""
    sizes = {name: 4 * math.prod(shape) for name, shape in layout}
    target = fraction * sum(sizes.values())
    names = [name for name, _ in layout]
    random.Random(TRAINABLE_SEED).shuffle(names)
    chosen: list[str] = []
    used = 0
    for name in names:
        if used + sizes[name] <= target:
            chosen.append(name)
            used += sizes[name]
    rest = [n for n in names if n not in chosen]
    if rest:
        best = min(rest, key=lambda n: abs(used + sizes[n] - target))
        if abs(used + sizes[best] - target) < abs(used - target):
            chosen.append(best)
    order = {name: i for i, (name, _) in enumerate(layout)}
    return sorted(chosen, key=order.__getitem__)


# -- the workers -----------------------------------------------------------------------------------------------


class _WorkerLog:
    """Progress lines on stderr in the parent's format (elapsed seconds since the parent's log started)."""

    def __init__(self, t0_wall: float, verbose: bool) -> None:
        self.t0_wall = t0_wall
        self.verbose = verbose

    def __call__(self, msg: str) -> None:
        if self.verbose:
            print(f"[{time.time() - self.t0_wall:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as tdist

    warnings.filterwarnings("ignore")  # DCP's notices (e.g. about DTensor, or planner defaults) are not results
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        out = _Worker(rank, world, cfg).run()
        if rank == 0:
            tmp = cfg["result_path"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, cfg["result_path"])
        tdist.barrier()
    finally:
        tdist.destroy_process_group()
    # Done: leave without interpreter finalization. Objects that outlive destroy_process_group (the device mesh,
    # DCP's cached state) can otherwise tear gloo's worker threads down mid-finalization, an occasional SIGABRT
    # ("terminate called without an active exception") after every result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Worker:
    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as tdist
        import torch.distributed.checkpoint as dcp

        import luopan
        import luopan.dcp

        self.torch, self.tdist, self.dcp, self.luopan = torch, tdist, dcp, luopan
        self.rank, self.world = rank, world
        self.cfg = cfg
        self.work = cfg["work"]
        self.log = _WorkerLog(cfg["t0_wall"], cfg["verbose"] and rank == 0)
        self.problems: list[str] = []
        torch.set_num_threads(1)  # one rank per core, as on a machine with one rank per accelerator

    # -- helpers -----------------------------------------------------------------------------------------------
    def barrier(self) -> None:
        self.tdist.barrier()

    def timed_save(self, state: dict[str, Any], writer: Any) -> float:
        """Seconds of one collective dcp.save, on rank 0 from a barrier before it to a barrier after it."""
        if self.rank == 0:
            settle()
        with quiet_gc():
            self.barrier()
            t0 = time.perf_counter()
            self.dcp.save(state, storage_writer=writer)
            self.barrier()
            return time.perf_counter() - t0

    def drop(self, *paths: str) -> None:
        """Remove outputs (rank 0), sync, and wait for every rank."""
        self.barrier()
        if self.rank == 0:
            for p in paths:
                remove(p)
            settle()
        self.barrier()

    def new_repo(self, path: str) -> None:
        """A fresh repository, created untimed by rank 0 (as the other suites' luopan.open)."""
        if self.rank == 0:
            self.luopan.open(path).close()
        self.barrier()

    def info(self, path: str, run: str) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        with self.luopan.open(path, create=False) as repo:
            c = repo.checkpoints(run)[-1]
            return {"step": c.step, "logical_bytes": c.logical_bytes, "new_bytes": c.new_bytes,
                    "stored_bytes": c.stored_bytes, "chunks": c.chunks, "new_chunks": c.new_chunks}

    # -- sharded state (D1, D2) --------------------------------------------------------------------------------
    def sharded_state(self, layout: list[tuple[str, tuple[int, ...]]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(DTensor state dict, local shards): each rank generates only its own rows (seeded per rank)."""
        torch = self.torch
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (self.world,))
        g = torch.Generator().manual_seed(1000 + self.rank)
        local: dict[str, Any] = {}
        for name, shape in layout:
            a, b = rows_of(shape[0], self.rank, self.world)
            local[name] = torch.randn((b - a, *shape[1:]), generator=g, dtype=torch.float32)
        self.shapes = dict(layout)
        return self.wrap(local), local

    def wrap(self, local: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Shard

        out = {}
        for name, t in local.items():
            shape = self.torch.Size(self.shapes[name])
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            out[name] = DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
        return out

    def check_sharded(self, what: str, reader: Any, local: dict[str, Any]) -> None:
        """Load a checkpoint into zero-filled DTensors (DCP reshards) and compare with the local shards."""
        target_local = {k: self.torch.zeros_like(v) for k, v in local.items()}
        self.dcp.load(self.wrap(target_local), storage_reader=reader)
        bad = [k for k in local if not self.torch.equal(target_local[k], local[k])]
        if bad:
            self.problems.append(f"{what}: rank {self.rank}: {len(bad)} tensors differ after load, e.g. {bad[0]}")

    def train_step(self, local: dict[str, Any], names: list[str], g: Any) -> None:
        """One "training step": every element of the trainable tensors moves a little (untimed)."""
        torch = self.torch
        with torch.no_grad():
            for name in names:
                t = local[name]
                t.add_(torch.randn(t.shape, generator=g) * 1e-3)

    def scatter_rows(self, local: dict[str, Any], fraction: float, g: Any) -> int:
        """1% of the rows of every tensor (elements of a 1-D one) change, at random positions; returns the bytes."""
        torch = self.torch
        changed = 0
        with torch.no_grad():
            for t in local.values():
                n = t.shape[0]
                if n == 0:
                    continue
                k = max(1, round(fraction * n))
                rows = torch.randperm(n, generator=g)[:k]
                t[rows] += torch.randn((k, *t.shape[1:]), generator=g) * 1e-3
                changed += k * t[0].numel() * t.element_size()
        return changed

    # -- the suite ---------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        out = self.sharded()  # D1, D2: the sharded state lives (and is freed) in there
        out["d3"] = self.replicated()
        everyone: list[Any] = [None] * self.world
        self.tdist.all_gather_object(everyone, self.problems)
        out["problems"] = [p for ps in everyone for p in ps]
        return out

    def sharded(self) -> dict[str, Any]:
        torch, dcp, luopan = self.torch, self.dcp, self.luopan
        size_mib, reps, work = self.cfg["size_mib"], self.cfg["reps"], self.work
        layout = state_layout(size_mib)
        nbytes = sum(4 * math.prod(s) for _, s in layout)
        trainable = trainable_names(layout)
        changed_bytes = sum(4 * math.prod(s) for n, s in layout if n in trainable)
        log = self.log
        log(f"world {self.world} (gloo, 127.0.0.1): building a {size_mib} MiB fp32 state sharded Shard(0) over the "
            f"ranks ({len(layout)} tensors); a training step changes {len(trainable)} whole tensors, "
            f"{changed_bytes / MIB:.2f} MiB ({100 * changed_bytes / nbytes:.2f}%)")
        state, local = self.sharded_state(layout)
        g = torch.Generator().manual_seed(2000 + self.rank)
        samples: dict[str, list[float]] = {k: [] for k in ("d1_fs", "d1_lp", "d2_fs", "d2_lp", "d2_lp_hashing")}
        lp_first: list[dict[str, Any]] = []
        lp_second: list[dict[str, Any]] = []
        lp_hashing: list[dict[str, Any]] = []
        packs_growth: list[int] = []

        def peer(r: int) -> tuple[float, float]:
            a, b = os.path.join(work, f"fs{r}-first"), os.path.join(work, f"fs{r}-second")
            t1 = self.timed_save(state, dcp.FileSystemWriter(a))
            self.drop(a)
            self.train_step(local, trainable, g)
            t2 = self.timed_save(state, dcp.FileSystemWriter(b))
            if r == 0:
                self.check_sharded("D2 peer re-save (FileSystemReader)", dcp.FileSystemReader(b), local)
            self.drop(b)
            return t1, t2

        def ours(r: int) -> tuple[float, float]:
            p = os.path.join(work, f"lp{r}")
            self.new_repo(p)
            t1 = self.timed_save(state, luopan.dcp.Writer(p, RUN, 0, trust_versions=True))
            first = self.info(p, RUN)
            before = dir_bytes(os.path.join(p, "packs")) if self.rank == 0 else 0
            self.train_step(local, trainable, g)
            t2 = self.timed_save(state, luopan.dcp.Writer(p, RUN, 1, trust_versions=True))
            second = self.info(p, RUN)
            growth = dir_bytes(os.path.join(p, "packs")) - before if self.rank == 0 else 0
            if r == 0:
                self.check_sharded("D2 luopan re-save (luopan.dcp.Reader)", luopan.dcp.Reader(p, RUN, 1), local)
            self.train_step(local, trainable, g)  # context: the same re-save, every byte hashed
            hashing_s = self.timed_save(state, luopan.dcp.Writer(p, RUN, 2))
            third = self.info(p, RUN)
            if self.rank == 0:
                if r:
                    lp_first.append(first)
                    lp_second.append(second)
                    lp_hashing.append(third)
                    packs_growth.append(growth)
                    samples["d2_lp_hashing"].append(hashing_s)
                for i, got in enumerate((first, second, third)):
                    if got["logical_bytes"] != nbytes:
                        self.problems.append(f"luopan step {i}: logical_bytes {got['logical_bytes']} != {nbytes}")
            if r == 0:
                self.check_sharded("D2 luopan re-save, hashing (luopan.dcp.Reader)", luopan.dcp.Reader(p, RUN, 2),
                                   local)
            self.drop(p)
            return t1, t2

        log(f"D1/D2: {reps} repetitions (+1 warm-up) of FileSystemWriter first save + re-save / luopan.dcp.Writer "
            "first save + re-save")
        for r in range(reps + 1):  # the first repetition warms up (and checks both re-saves) and is not counted
            order = [("fs", peer), ("lp", ours)] if r % 2 == 0 else [("lp", ours), ("fs", peer)]
            got = {key: fn(r) for key, fn in order}
            if r:
                for key, (t1, t2) in got.items():
                    samples[f"d1_{key}"].append(t1)
                    samples[f"d2_{key}"].append(t2)
            log(f"  rep {r}{' (warm-up)' if not r else ''}: D1 FileSystemWriter {got['fs'][0]:.3f}s / luopan "
                f"{got['lp'][0]:.3f}s; D2 FileSystemWriter {got['fs'][1]:.3f}s / luopan {got['lp'][1]:.3f}s "
                f"(trust_versions)")

        # context: 1% of the rows of every tensor, scattered (one sample)
        p = os.path.join(work, "lp-scattered")
        self.new_repo(p)
        self.dcp.save(state, storage_writer=luopan.dcp.Writer(p, RUN, 0))
        before = dir_bytes(os.path.join(p, "packs")) if self.rank == 0 else 0
        scattered_local = self.scatter_rows(local, CHANGED_FRACTION, g)
        t_scat = self.timed_save(state, luopan.dcp.Writer(p, RUN, 1))
        scattered = {"luopan_s": t_scat, **self.info(p, RUN),
                     "packs_growth_bytes": (dir_bytes(os.path.join(p, "packs")) - before) if self.rank == 0 else 0,
                     "changed_bytes_rank0": scattered_local}
        log(f"context: 1% of the rows of every tensor changed (scattered): luopan re-save {t_scat:.3f}s, wrote "
            f"{scattered.get('new_bytes', 0) / MIB:.1f} MiB")
        self.drop(p)
        return {
            "state_bytes": nbytes,
            "tensors": len(layout),
            "matrices_2d": sum(1 for _, s in layout if len(s) == 2),
            "vectors_1d": sum(1 for _, s in layout if len(s) == 1),
            "rank_bytes": [sum(4 * (rows_of(s[0], r, self.world)[1] - rows_of(s[0], r, self.world)[0])
                               * math.prod(s[1:]) for _, s in layout) for r in range(self.world)],
            "trainable": trainable,
            "changed_bytes": changed_bytes,
            "samples_s": samples,
            "lp_first": lp_first,
            "lp_second": lp_second,
            "lp_hashing": lp_hashing,
            "packs_growth": packs_growth,
            "scattered": scattered,
        }

    def replicated(self) -> dict[str, Any]:
        """D3: a DDP-style state, the same full tensors on every rank."""
        torch, dcp, luopan = self.torch, self.dcp, self.luopan
        size_mib, work, log = self.cfg["size_mib"], self.work, self.log
        log(f"D3: a replicated {size_mib} MiB state (the same on both ranks), saved once with each writer")
        full = build_state(size_mib, seed=3)
        d3_bytes = sum(t.numel() * t.element_size() for t in full.values())
        p = os.path.join(work, "d3-luopan")
        self.new_repo(p)
        t_lp = self.timed_save(dict(full), luopan.dcp.Writer(p, DDP_RUN, 0))
        d3_info = self.info(p, DDP_RUN)
        d3_packs = dir_bytes(os.path.join(p, "packs")) if self.rank == 0 else 0
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp.load(target, storage_reader=luopan.dcp.Reader(p, DDP_RUN))
        bad = [k for k in full if not torch.equal(target[k], full[k])]
        if bad:
            self.problems.append(f"D3: rank {self.rank}: {len(bad)} tensors differ after load, e.g. {bad[0]}")
        del target
        self.drop(p)
        fs = os.path.join(work, "d3-fs")
        t_fs = self.timed_save(dict(full), dcp.FileSystemWriter(fs))
        fs_bytes = dir_bytes(fs) if self.rank == 0 else 0
        self.drop(fs)
        log(f"D3: luopan {t_lp:.3f}s, packs {d3_packs} bytes for a {d3_bytes} byte state; FileSystemWriter "
            f"{t_fs:.3f}s, {fs_bytes} bytes")

        return {"state_bytes": d3_bytes, "packs_bytes": d3_packs, "info": d3_info, "luopan_s": t_lp, "fs_s": t_fs,
                "fs_bytes": fs_bytes, "tensors": len(full)}


# -- the parent ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_dist(size_mib: int, reps: int, workdir_parent: str | None, log: Any) -> dict[str, Any]:
    if workdir_parent is not None:
        os.makedirs(workdir_parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="luopan-bench-dist-", dir=workdir_parent)
    try:
        return _run(size_mib, reps, work, log)
    finally:
        remove(work)
        settle()


def _run(size_mib: int, reps: int, work: str, log: Any) -> dict[str, Any]:
    import torch.multiprocessing as mp

    nbytes = size_mib * MIB
    need = 2 * nbytes + 256 * MIB
    st = os.statvfs(work)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise SystemExit(f"not enough free space in {work}: {free / MIB:.0f} MiB free, about {need / MIB:.0f} MiB "
                         "needed (2x the state); pass --workdir on a bigger disk or a smaller --size-mib")
    machine = machine_info(work)
    port = free_port()
    result_path = os.path.join(work, "result.json")
    t0_wall = time.time() - (time.perf_counter() - getattr(log, "t0", time.perf_counter()))
    cfg = {"size_mib": size_mib, "reps": reps, "work": work, "result_path": result_path, "t0_wall": t0_wall,
           "verbose": bool(getattr(log, "verbose", True))}
    log(f"spawning {WORLD} worker processes (gloo on 127.0.0.1:{port}); workdir {work}")
    mp.spawn(_worker, args=(WORLD, port, cfg), nprocs=WORLD, join=True)
    with open(result_path) as f:
        w = json.load(f)
    machine["loadavg_end"] = loadavg()
    return assemble(w, size_mib, reps, port, machine)


def assemble(w: dict[str, Any], size_mib: int, reps: int, port: int, machine: dict[str, Any]) -> dict[str, Any]:
    s = w["samples_s"]
    nbytes = w["state_bytes"]
    problems = list(w["problems"])
    d1 = _ratio_result(
        "D1.dcp_first_save_vs_filesystem", "FileSystemWriter", "dcp.save with FileSystemWriter(new directory), "
        "sync_files=True (fsync)", "d1_fs", "d1_lp", 1.0, s, nbytes,
        "A fresh directory / a fresh repository per repetition (luopan.open untimed); the state is sharded "
        "(DTensor Shard(0), each rank holds and writes only its rows). Timed on rank 0 from a barrier before "
        "dcp.save to a barrier after it.",
        luopan_new_bytes=[x["new_bytes"] for x in w["lp_first"]])
    second_new = [x["new_bytes"] for x in w["lp_second"]]
    d2 = _ratio_result(
        "D2.dcp_resave_vs_filesystem", "FileSystemWriter", "dcp.save with FileSystemWriter(a new "
        "directory) after one training step: it writes the whole state again", "d2_fs", "d2_lp", 10, s, nbytes,
        "After the first save (D1), one training step updates every element of a fixed set of whole tensors "
        f"({len(w['trainable'])} tensors, {w['changed_bytes']} bytes = {100 * w['changed_bytes'] / nbytes:.2f}% "
        "of the state); then the second save: FileSystemWriter into a new directory / luopan.dcp.Writer into the "
        "same repository at step 1 with trust_versions=True (as its first save): tensors whose version counter "
        "did not move reuse their previous chunks unread; the changed ones are hashed and only changed chunks "
        "written. Extra field `hashing`: the same re-save without trust_versions (every byte hashed; another "
        "training step later, at step 2). Extra field `scattered`: one luopan re-save after 1% of the rows of "
        "every tensor changed at random positions (context: whole 4 MiB chunks are rewritten, luopan.dcp stores "
        "no row deltas).",
        changed_bytes=w["changed_bytes"], changed_fraction=w["changed_bytes"] / nbytes,
        trainable_tensors=w["trainable"], luopan_resave_new_bytes=second_new,
        luopan_resave_stored_bytes=[x["stored_bytes"] for x in w["lp_second"]],
        luopan_resave_packs_growth_bytes=w["packs_growth"],
        luopan_resave_bytes_over_changed=(round(median(second_new) / w["changed_bytes"], 4)
                                          if second_new and w["changed_bytes"] else None),
        hashing=_hashing(w, s), scattered=_scattered(w, s, nbytes))
    d3w = w["d3"]
    value = d3w["packs_bytes"] / d3w["state_bytes"]
    info = d3w["info"]
    if info.get("logical_bytes") != d3w["state_bytes"]:
        problems.append(f"D3: logical_bytes {info.get('logical_bytes')} != {d3w['state_bytes']}")
    d3 = {
        "id": "D3.ddp_bytes_over_state",
        "peer": "state bytes (every rank holds the same full tensors)",
        "peer_short": "replicated state",
        "ratio": round(value, 4),
        "value": round(value, 4),
        "goal": 1.05,
        "goal_op": "<=",
        "met": value <= 1.05,
        "unit": "bytes of pack files under <repo>/packs after both ranks saved / state bytes",
        "state_bytes": d3w["state_bytes"],
        "packs_bytes": d3w["packs_bytes"],
        "tensors": d3w["tensors"],
        "checkpoint": info,
        "luopan_s": d3w["luopan_s"],
        "peer_s": d3w["fs_s"],
        "peer_bytes": d3w["fs_bytes"],
        "peer_bytes_over_state": round(d3w["fs_bytes"] / d3w["state_bytes"], 4),
        "notes": "One measurement (a byte count). Both ranks call dcp.save with the same replicated state dict "
                 "(torch.randn, seed 3: no duplicate chunks); DCP's planner gives each item to one rank. "
                 "packs_bytes: sum of the file sizes under <repo>/packs. Context (one sample each): both save times "
                 "and FileSystemWriter's bytes on disk (its .distcp files and .metadata). The checkpoint is loaded "
                 "back on both ranks and compared.",
    }
    results = [d1, d2, d3]
    if problems:
        for r in results:
            r["met"] = False
            r["notes"] += " DATA PROBLEM: " + "; ".join(problems)
    return {
        "suite": "dist",
        "size_mib": size_mib,
        "machine": machine,
        "state": {
            "bytes": nbytes,
            "tensors": w["tensors"],
            "matrices_2d": w["matrices_2d"],
            "vectors_1d": w["vectors_1d"],
            "dtype": "float32",
            "rank_bytes": w["rank_bytes"],
            "layout": "decoder-style, as the foundation suite (benchmarks/foundation.py state_layout); every tensor "
                      "a DTensor Shard(0) over the 2 ranks",
            "generator": "torch.randn per rank (seeds 1000 + rank), each rank only its own rows: nothing compresses "
                         "or deduplicates",
            "training_step": f"{len(w['trainable'])} whole tensors ({w['changed_bytes']} bytes, "
                             f"{100 * w['changed_bytes'] / nbytes:.2f}%), each element += 1e-3 * randn",
            "d3_state": "benchmarks/foundation.py build_state(seed=3) on both ranks, plain tensors",
        },
        "config": {
            "reps": reps,
            "world_size": WORLD,
            "backend": "gloo",
            "master": f"127.0.0.1:{port}",
            "spawn": "torch.multiprocessing.spawn, two processes kept for the whole suite; torch.set_num_threads(1) "
                     "in each",
            "timing": "rank 0, barrier before dcp.save to barrier after it; sync + gc.collect before, GC paused",
            "peer": "torch.distributed.checkpoint.FileSystemWriter defaults (single_file_per_rank=True, "
                    "sync_files=True, thread_count=1)",
            "luopan": "luopan.dcp.Writer(repo path, run, step, trust_versions=True); a fresh repository per "
                      "repetition (luopan.open by rank 0, untimed); the re-save goes into the same repository at step "
                      "1 (and, context, one more without trust_versions at step 2)",
            "page_cache": "warm (the state is in memory; saves write to the page cache and fsync)",
        },
        "results": results,
        "samples_s": s,
        "problems": problems,
    }


def _hashing(w: dict[str, Any], s: dict[str, list[float]]) -> dict[str, Any]:
    lp = s.get("d2_lp_hashing") or []
    fs = median(s["d2_fs"])
    return {
        "luopan_s": median(lp) if lp else None,
        "luopan_samples_s": lp,
        "ratio_vs_filesystem_median": ratio(fs, median(lp)) if lp else None,
        "new_bytes": [x["new_bytes"] for x in w.get("lp_hashing", [])],
    }


def _scattered(w: dict[str, Any], s: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    sc = w["scattered"]
    fs = median(s["d2_fs"])
    return {
        "luopan_s": sc["luopan_s"],
        "ratio_vs_filesystem_median": ratio(fs, sc["luopan_s"]),
        "new_bytes": sc.get("new_bytes"),
        "new_over_state": round(sc["new_bytes"] / nbytes, 4) if sc.get("new_bytes") is not None else None,
        "packs_growth_bytes": sc.get("packs_growth_bytes"),
        "changed_bytes_rank0": sc.get("changed_bytes_rank0"),
    }


# -- the table -------------------------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    head = ["id", "peer", "peer", "luopan", "value", "goal", "status"]
    rows = []
    xrows = []
    for r in report["results"]:
        status = "met" if r["met"] else "MISSED"
        goal = f"{r['goal_op']} {r['goal']}"
        if r["id"].startswith("D3"):
            rows.append([r["id"], r["peer_short"], f"{r['state_bytes'] / MIB:.1f} MiB",
                         f"{r['packs_bytes'] / MIB:.1f} MiB packs", _fmt(r["value"], ".4f"), goal, status])
            xrows.append([f"{r['id']} (save s, one sample)", _fmt(r["peer_s"]) + " s", _fmt(r["luopan_s"]) + " s",
                          _fmt(ratio(r["peer_s"], r["luopan_s"]), ".2f")])
            xrows.append([f"{r['id']} (bytes on disk / state)", _fmt(r["peer_bytes_over_state"], ".4f"),
                          _fmt(r["value"], ".4f"), "-"])
            continue
        rows.append([r["id"], r["peer_short"], _fmt(r["peer_s"]) + " s", _fmt(r["luopan_s"]) + " s",
                     _fmt(r["ratio"], ".2f"), goal, status])
        xrows.append([f"{r['id']} (GiB/s)", _fmt(r["peer_gib_s"], ".2f"), _fmt(r["luopan_gib_s"], ".2f"), "-"])
        if r["id"].startswith("D2"):
            nb = r["luopan_resave_new_bytes"]
            xrows.append([f"{r['id']} (MiB changed / written by the re-save)",
                          f"{r['changed_bytes'] / MIB:.2f}",
                          f"{median(nb) / MIB:.2f}" if nb else "-", _fmt(r["luopan_resave_bytes_over_changed"], ".2f")])
            hs = r["hashing"]
            xrows.append([f"{r['id']} (re-save without trust_versions: every byte hashed)", _fmt(r["peer_s"]) + " s",
                          _fmt(hs["luopan_s"]) + " s", _fmt(hs["ratio_vs_filesystem_median"], ".2f")])
            sc = r["scattered"]
            xrows.append([f"{r['id']} (1% of rows of every tensor, scattered)", _fmt(r["peer_s"]) + " s",
                          f"{sc['luopan_s']:.3f} s, wrote {_fmt(sc['new_over_state'], '.2f')}x state",
                          _fmt(sc["ratio_vs_filesystem_median"], ".2f")])
    st = report["state"]
    title = (f"luopan dist benchmark: world size {report['config']['world_size']} (gloo), "
             f"{st['bytes'] / MIB:.0f} MiB fp32 state ({st['tensors']} tensors), DCP save, medians of "
             f"{report['config']['reps']} alternating repetitions")
    print_tables(title, head, rows, ["context (not goals)", "peer", "luopan", "ratio"], xrows)
    print_footer(report, "D1, D2 ratio = FileSystemWriter seconds / luopan.dcp.Writer seconds (> 1: luopan faster); D3 = "
                 "pack bytes / state bytes (lower is better).")

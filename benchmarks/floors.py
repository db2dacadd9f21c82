"""This machine's physical floors for the operations docs/performance.md compares (issue 29).

    .venv/bin/python benchmarks/floors.py                 # 1 GiB, prints a table
    .venv/bin/python benchmarks/floors.py --size-mib 256 --json floors.json

Each figure is the best of ``--reps`` runs (a floor: the least the machine needed), in GB/s:

* ``write_fsync``: one ``write`` of the bytes to a new file, then ``fsync`` (what any durable save must pay);
* ``write_page_cache``: the same ``write`` without the fsync (the copy into the page cache alone);
* ``read_warm``: ``readinto`` of that file into a preallocated buffer, the file in the page cache;
* ``memcpy``: one copy between two preallocated buffers (NumPy);
* ``alloc_fault``: touching a fresh allocation of that size (page faults, zero-fill: a load into new tensors);
* ``blake3_1core`` / ``blake3_all``: BLAKE3 of the bytes on one core, and in 4 MiB chunks on every core;
* ``xxh3_1core``: XXH3-128 of the bytes on one core.

From these, a 1 GiB save's floor is ``max(write_fsync, blake3_all)`` time when the two overlap perfectly, and a
verified load's floor is ``read_warm`` plus ``blake3_all`` shared over the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np
import xxhash

CHUNK = 4 << 20


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(size_mib: int = 1024, reps: int = 3, workdir: str | None = None) -> dict[str, float]:
    n = size_mib << 20
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    view = memoryview(data)
    out = np.empty(n, dtype=np.uint8)
    d = tempfile.mkdtemp(prefix="luopan-floors-", dir=workdir)
    path = os.path.join(d, "f")
    workers = os.cpu_count() or 2

    def write(sync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < n:
                off += os.write(fd, view[off : off + (256 << 20)])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            mv, off = memoryview(out), 0
            while off < n:
                got = f.readinto(mv[off:])
                if not got:
                    break
                off += got

    def fault() -> None:
        a = np.empty(n, dtype=np.uint8)
        a[::4096] = 1

    def b3_all() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda o: blake3.blake3(view[o : o + CHUNK]).digest(), range(0, n, CHUNK)))

    try:
        secs = {
            "write_fsync": _best(lambda: write(True), reps),
            "write_page_cache": _best(lambda: write(False), reps),
            "read_warm": _best(read, reps),
            "memcpy": _best(lambda: np.copyto(out, data), reps),
            "alloc_fault": _best(fault, reps),
            "blake3_1core": _best(lambda: blake3.blake3(view).digest(), reps),
            "blake3_all": _best(b3_all, reps),
            "xxh3_1core": _best(lambda: xxhash.xxh3_128_digest(view), reps),
        }
    finally:
        for p in (path,):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(d)
    return {k: round(n / v / 1e9, 3) for k, v in secs.items()} | {"size_bytes": n, "cores": workers}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args()
    floors = measure(args.size_mib, args.reps, args.workdir)
    gib = args.size_mib / 1024
    print(f"physical floors, {args.size_mib} MiB, {floors['cores']} cores (best of {args.reps}):")
    for k, v in floors.items():
        if k not in ("size_bytes", "cores"):
            print(f"  {k:18s} {v:7.2f} GB/s   ({args.size_mib / 1024 * 1.073741824 / v:.3f} s for {gib:g} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(floors, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

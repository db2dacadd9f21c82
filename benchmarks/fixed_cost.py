"""The fixed cost of a save (issue 29): a 1-tensor save, timed many times, with its fsyncs counted.

    .venv/bin/python benchmarks/fixed_cost.py [--saves 60] [--json OUT]

Prints the wall time (fastest and median), the process CPU time (median; user + system, so the fsync system calls'
own CPU is in it), the fsyncs per save, and the wall time spent outside fsync calls: the goal is under 3 ms of work
beyond the fsyncs a durable save needs (pack, index file, manifest and ref, each file and its directory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import luopan
except ImportError:  # running from a checkout without an installed luopan
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    import luopan
import numpy as np


def measure(saves: int = 60, workdir: str | None = None) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix="luopan-fixed-", dir=workdir)
    real_fsync = os.fsync
    count = [0]
    inside = [0.0]  # seconds spent in fsync calls

    def counting(fd: int) -> None:
        count[0] += 1
        t = time.perf_counter()
        try:
            real_fsync(fd)
        finally:
            inside[0] += time.perf_counter() - t

    try:
        repo = luopan.open(os.path.join(d, "r"))
        state = {"x": np.zeros(4, dtype=np.float32)}
        for i in range(5):  # warm-up: directories, thread pools, the chunk index
            state["x"] += 1
            repo.save("one", i, state)
        os.fsync = counting
        walls, cpus, beyond = [], [], []
        for i in range(5, 5 + saves):
            state["x"] += 1
            inside[0] = 0.0
            t, c = time.perf_counter(), time.process_time()
            repo.save("one", i, state)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
            beyond.append(walls[-1] - inside[0])
        os.fsync = real_fsync
        repo.close()
        probe = os.open(os.path.join(d, "probe"), os.O_WRONLY | os.O_CREAT, 0o644)
        ts = []
        for _ in range(30):
            os.write(probe, b"x" * 100)
            t = time.perf_counter()
            real_fsync(probe)
            ts.append(time.perf_counter() - t)
        os.close(probe)
    finally:
        os.fsync = real_fsync
        shutil.rmtree(d, ignore_errors=True)
    fsyncs = count[0] / saves
    fsync_ms = statistics.median(ts) * 1e3
    wall_ms = statistics.median(walls) * 1e3
    return {"saves": saves, "wall_min_ms": round(min(walls) * 1e3, 3), "wall_median_ms": round(wall_ms, 3),
            "cpu_median_ms": round(statistics.median(cpus) * 1e3, 3), "fsyncs_per_save": round(fsyncs, 2),
            "fsync_median_ms": round(fsync_ms, 3),
            "beyond_fsyncs_ms": round(statistics.median(beyond) * 1e3, 3),
            "beyond_fsyncs_min_ms": round(min(beyond) * 1e3, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=60)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    r = measure(args.saves, args.workdir)
    print(f"1-tensor save, {r['saves']} saves: wall {r['wall_min_ms']:.2f} ms fastest, {r['wall_median_ms']:.2f} ms "
          f"median; process CPU {r['cpu_median_ms']:.2f} ms median; {r['fsyncs_per_save']:.1f} fsyncs per save "
          f"(a small fsync here: {r['fsync_median_ms']:.2f} ms); time outside the fsyncs {r['beyond_fsyncs_ms']:.2f} ms "
          f"median, {r['beyond_fsyncs_min_ms']:.2f} ms fastest (goal < 3 ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""T2: garbage collection + repack time per GiB of live data, after pruning half of 20 checkpoints.

Each of the 20 saves writes new ``x`` (2/3 of the changing bytes, new every step); even steps also write a new ``y``
(1/3, reused by the following odd step); ``base`` never changes. The prune keeps the newest of every two steps (the
odd ones), so each even save's pack is one third live (its ``y`` is still used by the next odd step): gc repacks
those (under the 0.5 threshold) and then deletes them, as well as packs nothing needs at all. The figure is gc wall time / GiB of live data afterwards, with the time
per phase (mark, repack copy, manifest rewrites, plan, index, sweep) as the profile.

    python benchmarks/gc_bench.py [--size-mib 256] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import luopan
except ImportError:  # a checkout without an installed luopan
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
    import luopan

from luopan.retention import KeepEverySteps, KeepLast

CHECKPOINTS = 20


def measure_t2(workdir: str, size_mib: int, log: Any = print) -> dict[str, Any]:
    """Build 20 checkpoints of a ``size_mib`` state, prune the odd ones, time gc. Returns a results row."""
    root = tempfile.mkdtemp(prefix="luopan-t2-", dir=workdir)
    try:
        repo = luopan.open(os.path.join(root, "repo"))
        n = size_mib * (1 << 20) // 4
        rng = np.random.default_rng(0)
        state = {"base": rng.standard_normal(n // 2, dtype=np.float32),
                 "x": rng.standard_normal(n // 3, dtype=np.float32),
                 "y": rng.standard_normal(n - n // 2 - n // 3, dtype=np.float32)}
        t0 = time.perf_counter()
        for step in range(CHECKPOINTS):
            state["x"] = rng.standard_normal(state["x"].size, dtype=np.float32)
            if step % 2 == 0:
                state["y"] = rng.standard_normal(state["y"].size, dtype=np.float32)
            repo.save("t2", step, state)
        log(f"T2: {CHECKPOINTS} saves of {size_mib} MiB in {time.perf_counter() - t0:.1f} s")
        before = repo.du()
        plan = repo.prune("t2", KeepEverySteps(2) | KeepLast(1))
        t0 = time.perf_counter()
        rep = repo.gc(grace=0)
        seconds = time.perf_counter() - t0
        after = repo.du()
        live_gib = after["pack_bytes"] / (1 << 30)
        repo.verify()  # not timed: the result must still be whole
        repo.close()
        profile = {k: round(v, 4) for k, v in rep.seconds.items()}
        profile["other"] = round(seconds - sum(rep.seconds.values()), 4)  # lock, temporaries, report
        log(f"T2: pruned {len(plan.remove)} of {CHECKPOINTS}; gc {seconds:.2f} s for {live_gib * 1024:.0f} MiB live "
            f"({seconds / live_gib:.2f} s/GiB): deleted {rep.deleted_packs} packs ({rep.deleted_bytes >> 20} MiB), "
            f"repacked {rep.repacked_packs} ({rep.copied_bytes >> 20} MiB copied), rewrote "
            f"{rep.manifests_rewritten} manifests; phases {profile}")
        return {
            "id": "T2.gc_s_per_gib",
            "what": "gc + repack wall time per GiB of live data, after pruning half of 20 checkpoints",
            "value": seconds / live_gib,
            "goal": None,
            "met": None,
            "gc_s": seconds,
            "live_bytes": after["pack_bytes"],
            "pack_bytes_before": before["pack_bytes"],
            "deleted_packs": rep.deleted_packs,
            "deleted_bytes": rep.deleted_bytes,
            "repacked_packs": rep.repacked_packs,
            "copied_bytes": rep.copied_bytes,
            "manifests_rewritten": rep.manifests_rewritten,
            "profile_s": profile,
            "size_mib": size_mib,
            "checkpoints": CHECKPOINTS,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=64, help="state size per checkpoint (default 64)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    row = measure_t2(args.workdir or tempfile.gettempdir(), args.size_mib)
    print(f"{row['id']}: {row['value']:.3f} s/GiB  profile {row['profile_s']}")


if __name__ == "__main__":
    main()

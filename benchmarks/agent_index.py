"""The `index` suite: FAISS vector-index snapshots (luopan.index) against faiss's own files.

I1.full_over_written: a random float32 IVF-flat index (1,000,000 x 128, nlist 1024; --quick 200,000 x 128, nlist
256), trained on a 50,000-vector sample, is snapshotted; 1% more vectors are added and it is snapshotted again.
Value = bytes of `faiss.write_index` of the grown index / bytes luopan wrote for the second snapshot (the growth of
the repository directory: packs, index file, manifest, current ref). Goal >= 20.

I2.load_vs_faiss: `faiss.read_index(path)` seconds / `IndexStore.load()` seconds for the grown index, medians of
`reps` alternating repetitions after a warm-up (warm page cache; the order flips every repetition). Goal >= 0.8.
The warm-up checks that both give the original index's search results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dir_bytes, median, remove, settle, timed


def _result(rid: str, value: float, goal: float, unit: str, notes: str, **raw: Any) -> dict[str, Any]:
    return {"id": rid, "value": value, "ratio": value, "goal": goal, "goal_op": ">=", "met": value >= goal,
            "unit": unit, "notes": notes, **raw}


def run_index(quick: bool, workdir: str | None, log: Any = print, reps: int = 5) -> list[dict[str, Any]]:
    import faiss

    import luopan

    n, d, nlist = (200_000, 128, 256) if quick else (1_000_000, 128, 1024)
    rng = np.random.default_rng(20240601)
    base = tempfile.mkdtemp(prefix="luopan-index-", dir=workdir)
    try:
        log(f"building IVF-flat {n} x {d}, nlist {nlist}")
        x = rng.standard_normal((n, d), dtype=np.float32)
        index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nlist)
        index.train(x[rng.choice(n, min(n, 50_000), replace=False)])
        index.add(x)
        del x
        repo_path = os.path.join(base, "repo")
        repo = luopan.open(repo_path)
        idx = luopan.index.IndexStore(repo, "bench")
        t_first, _v = timed(lambda: idx.snapshot(index, params={"nlist": nlist}))
        settle()
        before = dir_bytes(repo_path)
        index.add(rng.standard_normal((n // 100, d), dtype=np.float32))
        t_second, _v = timed(lambda: idx.snapshot(index, params={"nlist": nlist}))
        settle()
        written = dir_bytes(repo_path) - before
        path = os.path.join(base, "grown.faiss")
        faiss.write_index(index, path)
        full = os.path.getsize(path)
        stats = idx.info()["stats"]
        i1 = _result("I1.full_over_written", full / written, 20.0, "x",
                     "write_index bytes of the grown index / repository growth of its second snapshot",
                     full_bytes=full, written_bytes=written, manifest_stats=stats,
                     snapshot_seconds=[t_first, t_second], n=n, d=d, nlist=nlist)
        log(f"I1: {full} / {written} = {full / written:.1f}x (snapshots {t_first:.2f} s, {t_second:.2f} s)")

        q = np.random.default_rng(1).standard_normal((100, d), dtype=np.float32)
        want = index.search(q, 10)
        got_faiss, got_luopan = faiss.read_index(path), idx.load()  # warm-up, and the results check
        for got in (got_faiss, got_luopan):
            res = got.search(q, 10)
            assert np.array_equal(res[0], want[0]) and np.array_equal(res[1], want[1])
        del got_faiss, got_luopan
        index = None  # free it before timing
        t_faiss: list[float] = []
        t_luopan: list[float] = []
        for rep in range(reps):
            order = [("faiss", lambda: faiss.read_index(path)), ("luopan", idx.load)]
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                dt, obj = timed(fn)
                del obj
                (t_faiss if name == "faiss" else t_luopan).append(dt)
        mf, ml = median(t_faiss), median(t_luopan)
        i2 = _result("I2.load_vs_faiss", mf / ml, 0.8, "x",
                     "faiss.read_index seconds / IndexStore.load() seconds (medians, warm page cache)",
                     faiss_seconds=mf, luopan_seconds=ml, samples={"faiss": t_faiss, "luopan": t_luopan},
                     index_bytes=full)
        log(f"I2: read_index {mf:.3f} s / load {ml:.3f} s = {mf / ml:.2f}x")
        repo.close()
        return [i1, i2]
    finally:
        remove(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    results = run_index(args.quick, args.workdir, reps=args.reps)
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

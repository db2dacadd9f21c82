"""The FAISS part of the `stacks` suite: an index that serves deletions, versioned with luopan vs `faiss.write_index`.

E3.write_index_over_luopan_with_deletes: a random float32 IVF-flat index (d 64, nlist 256; 100,000 vectors, --quick
20,000), ids 0..n-1, is snapshotted; then, for each of `versions` versions (10; --quick 6), 1% of the live ids are
removed (`remove_ids`) and 1% new vectors added (`add_with_ids`) — the same churn as tests/test_index_deletes.py —
and the index is stored twice: `faiss.write_index` to a new file per version (faiss's own way to keep versions: a
full file each time) and `IndexStore.snapshot` into a luopan repository. Value = mean bytes `write_index` writes
per version / mean repository growth per version (packs, index file, manifest, current ref). Goal >= 5. Every
version is loaded back from the repository and checked bit for bit against `faiss.serialize_index` of the index
that was snapshotted. Times per version of both are reported (seconds; not part of the goal).
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

GOAL = 5.0


def run(quick: bool, workdir: str | None, log: Any = print) -> list[dict[str, Any]]:
    import faiss

    import luopan

    n, d, nlist, versions = (20_000, 64, 256, 6) if quick else (100_000, 64, 256, 10)
    rng = np.random.default_rng(20261205)
    base = tempfile.mkdtemp(prefix="luopan-stacks-faiss-", dir=workdir)
    try:
        log(f"E3: IVF-flat {n} x {d}, nlist {nlist}; {versions} versions of 1% removed + 1% added")
        x = rng.standard_normal((n, d), dtype=np.float32)
        index = faiss.IndexIVFFlat(faiss.IndexFlatL2(d), d, nlist)
        index.train(x[: min(n, 50_000)])
        index.add_with_ids(x, np.arange(n))
        del x
        alive, next_id = np.arange(n), n
        repo_path = os.path.join(base, "repo")
        files = os.path.join(base, "faiss")
        os.mkdir(files)
        luopan_bytes: list[int] = []
        faiss_bytes: list[int] = []
        luopan_s: list[float] = []
        faiss_s: list[float] = []
        with luopan.open(repo_path) as repo:
            idx = luopan.index.IndexStore(repo, "kb")
            idx.snapshot(index)
            faiss.write_index(index, os.path.join(files, "v1.faiss"))
            expected = {}
            for v in range(2, versions + 2):
                gone = rng.choice(alive, n // 100, replace=False)
                index.remove_ids(gone)
                new_ids = np.arange(next_id, next_id + n // 100)
                index.add_with_ids(rng.standard_normal((n // 100, d), dtype=np.float32), new_ids)
                alive = np.concatenate([np.setdiff1d(alive, gone), new_ids])
                next_id += n // 100
                settle()
                before = dir_bytes(repo_path)
                dt, got = timed(lambda: idx.snapshot(index))
                settle()
                assert got == v
                luopan_bytes.append(dir_bytes(repo_path) - before)
                luopan_s.append(dt)
                path = os.path.join(files, f"v{v}.faiss")
                dt, _ = timed(lambda: faiss.write_index(index, path))
                settle()
                faiss_bytes.append(os.path.getsize(path))
                faiss_s.append(dt)
                expected[v] = faiss.serialize_index(index).tobytes()
            for v, want in expected.items():  # every version loads as the index that was snapshotted
                if faiss.serialize_index(idx.load(v)).tobytes() != want:
                    raise AssertionError(f"version {v} does not load bit for bit as the index snapshotted")
        ratio = float(np.mean(faiss_bytes) / np.mean(luopan_bytes))
        log(f"E3: write_index {np.mean(faiss_bytes):.0f} B / luopan {np.mean(luopan_bytes):.0f} B per version = "
            f"{ratio:.1f}x; seconds per version: write_index {median(faiss_s):.3f}, snapshot {median(luopan_s):.3f}")
        return [{
            "id": "E3.write_index_over_luopan_with_deletes", "value": ratio, "ratio": ratio, "goal": GOAL,
            "goal_op": ">=", "met": ratio >= GOAL, "unit": "x",
            "notes": (f"IVF-flat {n} x {d} (nlist {nlist}), {versions} versions of 1% remove_ids + 1% add: mean "
                      "faiss.write_index file bytes per version / mean luopan repository growth per version; every "
                      "version loaded back bit for bit"),
            "faiss_bytes_per_version": faiss_bytes, "luopan_bytes_per_version": luopan_bytes,
            "faiss_seconds_per_version": faiss_s, "luopan_seconds_per_version": luopan_s,
            "faiss_seconds_median": median(faiss_s), "luopan_seconds_median": median(luopan_s),
            "n": n, "d": d, "nlist": nlist, "versions": versions,
        }]
    finally:
        remove(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    results = run(args.quick, args.workdir)
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

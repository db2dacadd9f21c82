"""Chunk-size sweep (issue: choose the chunk size by measurement, P3 and P8; docs/format.md §5).

For each chunk size (``luopan.open(path, chunk_size=N)``), in alternating order across repetitions, every
measurement in a fresh repository:

* **P8 (unchanged re-save).** A NumPy state (``incremental.build_numpy_state``: 1024x1024 fp32 matrices, 4 MiB
  each, plus 4 KiB bias vectors) is saved in full (step 1), then re-saved unchanged as step 2.
  Reported: full save s, re-save s, re-save / full.
* **Manifest and load.** Size of step 1's manifest file (``runs/<run>/ckpt/00000001.json``) and the time of
  ``repo.load`` of step 1 (warm page cache: it was just written).
* **Scattered element updates, row deltas off** (``DeltaPolicy(enabled=False)``): a uniformly random
  ``--sparse-fraction`` (default 0.1%) of all elements of the state (not rows) get +1, then the state is re-saved
  (step 3). Reported: stored bytes / state bytes and re-save s. A second, sparser case (``--very-sparse-fraction``,
  default 0.001%) is re-saved as step 4: at 0.1% every chunk of >= 4 KiB holds a changed element, so that case
  shows the floor, the sparser one shows where chunk granularity starts to matter.
* **Clustered update**: one contiguous 1 MiB region (random start, within one tensor) gets +1 (step 5).
  Reported: stored bytes.
* **Large tensors** (``--large-tensor-mib``, default 64; 0 skips): the same full / unchanged / sparse / clustered
  saves on a state of that many MiB per matrix, so chunk sizes above 4 MiB split tensors too (with 4 MiB tensors a
  16 or 64 MiB chunk is the whole tensor, i.e. the same as 4 MiB).
* **P3-style row deltas** (default ``DeltaPolicy``, auto detection): an embedding table of ``size_mib / 2`` MiB
  (rows of 512 bytes, fp32 x 128), saved in full at step 0, then ``--intervals`` (default 6) interval saves each
  after a uniformly random 1% of the rows (scattered) got ``0.01 * N(0, 1)`` added. Reported: total stored bytes
  of the interval saves (the first change of a table is stored in full: lazy row tracking, §5.2), mean interval
  save s, load s of the last step (checked byte for byte against the state).

Each modification is undone after its save (old values restored), so every chunk size and repetition sees the same
states; the random positions are drawn per repetition (the same for every chunk size within a repetition). Saves are
timed with ``time.perf_counter`` around ``repo.save`` (GC paused), ``os.sync()`` before each. Reported figures are
medians over repetitions. One untimed warm-up save runs first.

    .venv/bin/python benchmarks/chunk_size.py [--size-mib 512] [--chunk-sizes 0.25 1 4 16 64] [--reps 3]
        [--json OUT] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import luopan  # noqa: F401
except ImportError:  # a checkout without an installed luopan
    sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))
    import luopan  # noqa: F401

from common import loadavg, machine_info, median, timed  # noqa: E402
from incremental import build_numpy_state  # noqa: E402

MIB = 1 << 20
RUN = "run"
TABLE = "emb.weight"


def build_large_state(size_mib: int, tensor_mib: int, seed: int = 1) -> dict[str, np.ndarray]:
    """fp32 matrices of ``tensor_mib`` MiB (rows of 8 KiB) totalling size_mib MiB; the last one takes the rest."""
    rng = np.random.default_rng(seed)
    total = size_mib << 20
    state: dict[str, np.ndarray] = {}
    i = 0
    while total > 0:
        n = min(total, tensor_mib << 20)
        state[f"layers.{i}.weight"] = rng.standard_normal((n // 8192, 2048), dtype=np.float32)
        total -= n
        i += 1
    return state


def settle() -> None:
    os.sync()


def timed_save(repo: Any, step: int, state: Any, **kw: Any) -> tuple[float, Any]:
    settle()
    return timed(lambda: repo.save(RUN, step, state, **kw))


class Flat:
    """Flat (1-D) views of a dict of arrays, for changing scattered elements and undoing it."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.names = list(state)
        self.flats = [state[k].reshape(-1) for k in self.names]
        self.sizes = np.array([f.size for f in self.flats], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.total = int(self.starts[-1])

    def change(self, idx: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """+1 at the global element indices ``idx``; returns what ``undo`` needs."""
        idx = np.sort(idx)
        which = np.searchsorted(self.starts, idx, side="right") - 1
        undo = []
        for a in np.unique(which):
            local = idx[which == a] - self.starts[a]
            f = self.flats[a]
            undo.append((f, local, f[local].copy()))
            f[local] += np.float32(1.0)
        return undo

    def change_region(self, rng: np.random.Generator, nbytes: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """+1 on one contiguous region of ``nbytes`` in a random tensor big enough to hold it, random start."""
        n = nbytes // 4
        cand = [i for i, f in enumerate(self.flats) if f.size >= n]
        a = cand[int(rng.integers(len(cand)))]
        f = self.flats[a]
        start = int(rng.integers(0, f.size - n + 1))
        local = np.arange(start, start + n)
        undo = [(f, local, f[local].copy())]
        f[start:start + n] += np.float32(1.0)
        return undo

    @staticmethod
    def undo(records: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for f, local, old in records:
            f[local] = old


def bench_state(state: dict[str, np.ndarray], chunk: int, path: str, rng_seed: int,
                sparse: float, very_sparse: float, region_bytes: int, with_load: bool) -> dict[str, Any]:
    import luopan

    flat = Flat(state)
    nbytes = flat.total * 4
    rng = np.random.default_rng(rng_seed)
    repo = luopan.open(path, chunk_size=chunk, delta_policy=luopan.DeltaPolicy(enabled=False))
    out: dict[str, Any] = {}
    t_full, info = timed_save(repo, 1, state)
    out["full_save_s"] = t_full
    out["full_stored_bytes"] = info.stored_bytes
    out["manifest_bytes"] = os.path.getsize(os.path.join(path, "runs", RUN, "ckpt", "00000001.json"))
    out["chunks"] = info.chunks
    t_again, info = timed_save(repo, 2, state)
    out["resave_s"] = t_again
    out["resave_stored_bytes"] = info.stored_bytes
    out["resave_over_full"] = t_again / t_full
    if with_load:
        t_load, loaded = timed(lambda: repo.load(RUN, 1))
        out["load_s"] = t_load
        del loaded
    step = 3
    for key, frac in (("sparse", sparse), ("very_sparse", very_sparse)):
        k = max(1, round(frac * flat.total))
        idx = rng.choice(flat.total, size=k, replace=False)
        undo = flat.change(idx)
        t, info = timed_save(repo, step, state)
        Flat.undo(undo)
        step += 1
        out[f"{key}_elements"] = k
        out[f"{key}_stored_bytes"] = info.stored_bytes
        out[f"{key}_new_bytes"] = info.new_bytes
        out[f"{key}_stored_over_state"] = info.stored_bytes / nbytes
        out[f"{key}_resave_s"] = t
    undo = flat.change_region(rng, region_bytes)
    t, info = timed_save(repo, step, state)
    Flat.undo(undo)
    out["clustered_stored_bytes"] = info.stored_bytes
    out["clustered_stored_over_region"] = info.stored_bytes / region_bytes
    out["clustered_resave_s"] = t
    repo.close()
    return out


def bench_p3(table: np.ndarray, chunk: int, path: str, intervals: int, change_fraction: float,
             seed: int) -> dict[str, Any]:
    import luopan

    rng = np.random.default_rng(seed)
    rows, width = table.shape
    k = max(1, round(change_fraction * rows))
    original = table.copy()
    repo = luopan.open(path, chunk_size=chunk, delta_policy=luopan.DeltaPolicy())
    state = {TABLE: table}
    try:
        t0, info0 = timed_save(repo, 0, state)
        stored, times, per = [], [], []
        for s in range(1, intervals + 1):
            idx = rng.choice(rows, size=k, replace=False)
            table[idx] += np.float32(0.01) * rng.standard_normal((k, width), dtype=np.float32)
            t, info = timed_save(repo, s, state)
            stored.append(info.stored_bytes)
            times.append(t)
        t_load, loaded = timed(lambda: repo.load(RUN, intervals))
        if not np.array_equal(loaded[TABLE].view(np.uint8), table.view(np.uint8)):
            raise AssertionError(f"P3 chunk_size={chunk}: last step loaded back different bytes")
        del loaded
        manifest = os.path.getsize(os.path.join(path, "runs", RUN, "ckpt", f"{intervals:08d}.json"))
        repo.close()
    finally:
        table[...] = original  # the next chunk size starts from the same table
    return {
        "full_save_s": t0,
        "full_stored_bytes": info0.stored_bytes,
        "interval_stored_bytes": stored,
        "total_interval_stored_bytes": sum(stored),
        "total_interval_stored_over_table": sum(stored) / table.nbytes,
        "steady_interval_stored_bytes": sum(stored[1:]),  # leaves out the first change (lazy tracking: full)
        "interval_save_s": times,
        "mean_save_s": sum(times) / len(times),
        "load_last_s": t_load,
        "last_manifest_bytes": manifest,
        "ratio": intervals * info0.stored_bytes / sum(stored) if sum(stored) else None,
    }


def fmt_size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n // 1024} KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="chunk-size sweep (see the module docstring)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--chunk-sizes", type=float, nargs="+", default=[0.25, 1, 4, 16, 64],
                    help="MiB, each a power of two (0.25 = 256 KiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--intervals", type=int, default=6, help="P3 interval saves per repetition")
    ap.add_argument("--sparse-fraction", type=float, default=0.001)
    ap.add_argument("--very-sparse-fraction", type=float, default=0.00001)
    ap.add_argument("--region-mib", type=float, default=1.0)
    ap.add_argument("--large-tensor-mib", type=int, default=64, help="0 skips the large-tensor state")
    ap.add_argument("--no-p3", action="store_true")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--workdir", help="parent of the scratch directory (default: the system temp dir)")
    args = ap.parse_args(argv)

    chunks = []
    for c in args.chunk_sizes:
        n = int(round(c * MIB))
        if n <= 0 or n & (n - 1):
            ap.error(f"chunk size {c} MiB is not a power of two in bytes")
        chunks.append(n)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="luopan-bench-chunk-", dir=args.workdir)
    region = int(args.region_mib * MIB)
    try:
        machine = machine_info(work)
        small = build_numpy_state(args.size_mib)
        states = {"numpy4": small}
        if args.large_tensor_mib:
            states[f"numpy{args.large_tensor_mib}"] = build_large_state(args.size_mib, args.large_tensor_mib)
        table_mib = max(16, args.size_mib // 2)
        table = None if args.no_p3 else np.random.default_rng(2).standard_normal(
            ((table_mib << 20) // 512, 128), dtype=np.float32)
        # warm-up (untimed): first-write effects, imports, thread pools
        import luopan
        warm = luopan.open(os.path.join(work, "warmup"))
        warm.save(RUN, 1, small)
        warm.load(RUN, 1)
        warm.close()
        shutil.rmtree(os.path.join(work, "warmup"))

        samples: dict[int, dict[str, list[dict[str, Any]]]] = {c: {k: [] for k in [*states, "p3"]} for c in chunks}
        for r in range(args.reps):
            order = chunks if r % 2 == 0 else chunks[::-1]
            for c in order:
                for sname, st in states.items():
                    path = os.path.join(work, f"r{r}-{c}-{sname}")
                    res = bench_state(st, c, path, 1000 + r, args.sparse_fraction,
                                      args.very_sparse_fraction, region, with_load=True)
                    shutil.rmtree(path)
                    samples[c][sname].append(res)
                    log(f"rep {r} chunk {fmt_size(c):>8} {sname:>8}: full {res['full_save_s']:.3f}s, "
                        f"re-save {res['resave_s']:.3f}s ({res['resave_over_full']:.3f}), "
                        f"load {res['load_s']:.3f}s, manifest {res['manifest_bytes']} B, "
                        f"sparse {res['sparse_stored_over_state']:.3f} ({res['sparse_resave_s']:.3f}s), "
                        f"very sparse {res['very_sparse_stored_over_state']:.4f}, "
                        f"clustered {res['clustered_stored_bytes'] / MIB:.2f} MiB")
                if table is not None:
                    path = os.path.join(work, f"r{r}-{c}-p3")
                    res = bench_p3(table, c, path, args.intervals, 0.01, 2000 + r)
                    shutil.rmtree(path)
                    samples[c]["p3"].append(res)
                    log(f"rep {r} chunk {fmt_size(c):>8}       p3: stored {res['total_interval_stored_bytes'] / MIB:.1f}"
                        f" MiB over {args.intervals} saves ({[round(b / MIB, 1) for b in res['interval_stored_bytes']]})"
                        f", mean save {res['mean_save_s']:.3f}s, load last {res['load_last_s']:.3f}s")
            log(f"  elapsed {time.perf_counter() - t_start:.0f}s")

        def med(rows: list[dict[str, Any]], key: str) -> Any:
            vals = [x[key] for x in rows]
            return median(vals) if vals and isinstance(vals[0], (int, float)) else None

        results = []
        for c in chunks:
            row: dict[str, Any] = {"chunk_size": c, "chunk_mib": c / MIB}
            for sname in states:
                keys = [k for k, v in samples[c][sname][0].items() if isinstance(v, (int, float))]
                row[sname] = {k: med(samples[c][sname], k) for k in keys}
            if table is not None:
                keys = [k for k, v in samples[c]["p3"][0].items() if isinstance(v, (int, float))]
                row["p3"] = {k: med(samples[c]["p3"], k) for k in keys}
                row["p3"]["interval_stored_bytes"] = samples[c]["p3"][0]["interval_stored_bytes"]
            results.append(row)

        # table
        lines = []
        for sname, st in states.items():
            sb = sum(a.nbytes for a in st.values())
            lines.append(f"\n[{sname}] state {sb / MIB:g} MiB, {len(st)} arrays; sparse = {args.sparse_fraction:g} of "
                         f"elements, very sparse = {args.very_sparse_fraction:g}; clustered = {args.region_mib:g} MiB")
            lines.append(f"{'chunk':>8} {'full s':>7} {'resave s':>8} {'ratio':>6} {'load s':>7} {'manifest':>9} "
                         f"{'sparse B/state':>14} {'sparse s':>8} {'vsparse B/state':>15} {'clustered MiB':>13}")
            for row in results:
                d = row[sname]
                lines.append(f"{fmt_size(row['chunk_size']):>8} {d['full_save_s']:7.3f} {d['resave_s']:8.3f} "
                             f"{d['resave_s'] / d['full_save_s']:6.3f} {d['load_s']:7.3f} "
                             f"{d['manifest_bytes'] / 1024:7.1f}Ki {d['sparse_stored_over_state']:14.3f} "
                             f"{d['sparse_resave_s']:8.3f} {d['very_sparse_stored_over_state']:15.4f} "
                             f"{d['clustered_stored_bytes'] / MIB:13.2f}")
        if table is not None:
            lines.append(f"\n[p3] table {table.nbytes / MIB:g} MiB ({table.shape[0]} rows x 512 B), 1% uniform rows "
                         f"per interval, {args.intervals} intervals, row deltas auto")
            lines.append(f"{'chunk':>8} {'stored MiB':>10} {'/table':>7} {'steady MiB':>10} {'mean save s':>11} "
                         f"{'load last s':>11} {'full s':>7}")
            for row in results:
                d = row["p3"]
                lines.append(f"{fmt_size(row['chunk_size']):>8} {d['total_interval_stored_bytes'] / MIB:10.1f} "
                             f"{d['total_interval_stored_over_table']:7.3f} "
                             f"{d['steady_interval_stored_bytes'] / MIB:10.1f} {d['mean_save_s']:11.3f} "
                             f"{d['load_last_s']:11.3f} {d['full_save_s']:7.3f}")
        elapsed = time.perf_counter() - t_start
        lines.append(f"\nelapsed {elapsed:.0f}s; load average start {machine['loadavg_start']}, end {loadavg()}")
        print("\n".join(lines))
        machine["loadavg_end"] = loadavg()
        if args.json:
            report = {
                "suite": "chunk_size",
                "size_mib": args.size_mib,
                "config": {k: v for k, v in vars(args).items() if k != "json"} | {"chunk_sizes_bytes": chunks},
                "machine": machine,
                "state_bytes": {s: sum(a.nbytes for a in st.values()) for s, st in states.items()},
                "p3_table_bytes": None if table is None else table.nbytes,
                "results": results,
                "samples": {str(c): samples[c] for c in chunks},
                "elapsed_s": round(elapsed, 1),
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            }
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
                f.write("\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

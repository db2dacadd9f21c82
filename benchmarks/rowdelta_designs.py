"""What other row-delta layouts would give on P3's workload (issue 15, part 2): a byte-accounting simulation.

P3 (benchmarks/rowdelta.py) saves a 512 MiB fp32 table (1,048,576 rows of 512 bytes) plus a 1 MiB dense layer, then
20 intervals in each of which a Zipf(s = 1.1) 1% of the rows changes, hot rows scattered by a random permutation.
``P3.full_over_written`` = 20 x (table + dense) / bytes written over the 20 intervals. This module replays the same
change sets (same generator, same seed) and counts the bytes each layout would write, without writing anything, so
the layouts can be compared before one is built. Every layout keeps the restore rule of docs/format.md §5.2 (base +
at most one patch, no chains) and the cap on a restore's extra reading (``cap``: patch bytes / table bytes, 0.08 by
default, what keeps P4 within 1.1x).

Layouts:

* ``flat``: today's format and policy (§5.2): one cumulative patch (8 bytes of index + the row per changed row),
  cut flat, written in full at every save; the whole table is rewritten (a new base) when the average rule or the
  cap says so. Its figure matches the measured P3 (11.2 here) within a few percent.
* ``regions-R``: the patch cut at every R-row region of the table, each piece a content-addressed chunk, so a region
  with no changed row since the previous save shares its chunks with it; whole-table rebase as ``flat``.
  ``+meta`` adds ~100 bytes of (compressed) manifest per chunk row and ~60 bytes of index per new chunk.
* ``two-level``: a stable patch (rewritten only at a compaction) plus a recent one (rows changed since that), both
  applied in order; compaction by the average rule one level down.
* ``region-bases-R``: the table's base itself cut into R-row chunks, each rebased on its own (a region whose patch
  passes the average rule or the cap is stored in full again); no manifest cost counted, so an upper bound.
* ``segments``: what luopan builds in repositories of format 7 (§5.2 "Segments"): the patch kept as segments, each
  the rows changed in one interval, applied in order; a save appends one while the segments (stale copies of rows
  changed again included) stay within the cap and number at most 16, else compacts them into one (the union), else
  rebases the whole table (average rule and cap as ``flat``).
* ``ideal-one-rebase``: the patch costs only the rows changed in the interval (no rewriting of the cumulative
  patch), with one whole-table rebase when the union of changed rows passes the cap: what any layout that still
  rebases the whole table could at best reach.

Run: ``.venv/bin/python benchmarks/rowdelta_designs.py [--rows 1048576] [--intervals 20] [--cap 0.08] [--json OUT]``
(a few seconds at full size).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

ROW_BYTES = 512  # 128 fp32 values, as in P3
DENSE = 1 << 20  # P3's dense layer, rewritten every interval


def changes(rows: int, intervals: int, fraction: float = 0.01, s: float = 1.1, seed: int = 0) -> list[np.ndarray]:
    """The sorted row sets P3's generator changes per interval (same Zipf model and Gumbel top-k sampling)."""
    rng = np.random.default_rng(seed)
    k = max(1, round(fraction * rows))
    perm = rng.permutation(rows)
    logw = np.empty(rows)
    logw[perm] = -s * np.log(np.arange(1, rows + 1, dtype=np.float64))
    out = []
    for _ in range(intervals):
        keys = logw + rng.gumbel(size=rows)
        out.append(np.sort(np.argpartition(keys, rows - k)[rows - k:]))
    return out


def flat(ch: list[np.ndarray], rows: int, cap: float) -> int:
    full = rows * ROW_BYTES
    union = np.zeros(rows, bool)
    cyc_bytes, cyc_n, written = full, 1, 0
    for c in ch:
        nu = union.copy()
        nu[c] = True
        p = int(nu.sum()) * (ROW_BYTES + 8)
        if p * cyc_n <= cyc_bytes and p <= cap * full:
            union, written, cyc_bytes, cyc_n = nu, written + p, cyc_bytes + p, cyc_n + 1
        else:
            union[:] = False
            written, cyc_bytes, cyc_n = written + full, full, 1
        written += DENSE
    return written


def regions(ch: list[np.ndarray], rows: int, cap: float, r: int, meta: bool) -> int:
    full = rows * ROW_BYTES
    union = np.zeros(rows, bool)
    cyc_bytes, cyc_n, written = full, 1, 0
    for c in ch:
        nu = union.copy()
        nu[c] = True
        p = int(nu.sum()) * (ROW_BYTES + 8)
        touched = np.unique(c // r)
        per_region = np.bincount(np.nonzero(nu)[0] // r, minlength=-(-rows // r))
        w = int(per_region[touched].sum()) * (ROW_BYTES + 8)
        if (cyc_bytes + w) * cyc_n <= cyc_bytes * (cyc_n + 1) and p <= cap * full:
            union, written, cyc_bytes, cyc_n = nu, written + w, cyc_bytes + w, cyc_n + 1
            if meta:  # two chunk rows (index, values) per non-empty region; index entries for the new chunks
                written += int(np.count_nonzero(per_region)) * 2 * 100 + len(touched) * 2 * 60
        else:
            union[:] = False
            written, cyc_bytes, cyc_n = written + full, full, 1
        written += DENSE
    return written


def two_level(ch: list[np.ndarray], rows: int, cap: float) -> int:
    full = rows * ROW_BYTES
    stable = np.zeros(rows, bool)
    recent = np.zeros(rows, bool)
    c2, n2, written = 0, 0, 0
    for c in ch:
        rn = recent.copy()
        rn[c] = True
        p2 = int(rn.sum()) * (ROW_BYTES + 8)
        both = stable | rn
        pu = int(both.sum()) * (ROW_BYTES + 8)
        if pu > cap * full:
            stable[:] = False
            recent[:] = False
            written, c2, n2 = written + full, 0, 0
        elif n2 and p2 * (n2 + 1) > c2 + p2:  # compaction: the union becomes the stable level
            stable, recent = both, np.zeros(rows, bool)
            written, c2, n2 = written + pu, pu, 1
        else:
            recent, written, c2, n2 = rn, written + p2, c2 + p2, n2 + 1
        written += DENSE
    return written


def region_bases(ch: list[np.ndarray], rows: int, cap: float, r: int) -> int:
    nreg = -(-rows // r)
    patch: list[set[int]] = [set() for _ in range(nreg)]
    cyc_bytes = np.full(nreg, r * ROW_BYTES, float)
    cyc_n = np.ones(nreg)
    written = 0
    for c in ch:
        regs = c // r
        for g in np.unique(regs):
            p = patch[g] | set(c[regs == g].tolist())
            cost = len(p) * (ROW_BYTES + 8)
            if cost <= cap * r * ROW_BYTES and cost * cyc_n[g] <= cyc_bytes[g]:
                patch[g] = p
                written += cost
                cyc_bytes[g] += cost
                cyc_n[g] += 1
            else:
                patch[g] = set()
                written += r * ROW_BYTES
                cyc_bytes[g], cyc_n[g] = r * ROW_BYTES, 1
        written += DENSE
    return written


def segments(ch: list[np.ndarray], rows: int, cap: float, max_segments: int = 16) -> int:
    full = rows * ROW_BYTES
    union = np.zeros(rows, bool)
    segs: list[int] = []  # bytes of each segment
    cyc_bytes, cyc_n, written = full, 1, 0
    for c in ch:
        nu = union.copy()
        nu[c] = True
        p = int(nu.sum()) * (ROW_BYTES + 8)
        new = len(c) * (ROW_BYTES + 8)
        if (segs and p <= cap * full and len(segs) < max_segments and sum(segs) + new <= cap * full
                and new * cyc_n <= cyc_bytes):
            segs.append(new)
            w = new
        elif p <= cap * full and p * cyc_n <= cyc_bytes:
            segs, w = [p], p
        else:
            segs, w = [], full
            nu[:] = False
            cyc_bytes, cyc_n = 0, 0
        union = nu
        written += w + DENSE
        cyc_bytes, cyc_n = cyc_bytes + w, cyc_n + 1
    return written


def ideal_one_rebase(ch: list[np.ndarray], rows: int, cap: float) -> int:
    full = rows * ROW_BYTES
    union = np.zeros(rows, bool)
    written = 0
    for c in ch:
        union[c] = True
        if union.sum() * (ROW_BYTES + 8) > cap * full:
            union[:] = False
            written += full
        else:
            written += len(c) * (ROW_BYTES + 8)
        written += DENSE
    return written


def simulate(rows: int = 1 << 20, intervals: int = 20, cap: float = 0.08,
             log: Callable[..., Any] = print) -> dict[str, Any]:
    ch = changes(rows, intervals)
    full = rows * ROW_BYTES
    layouts: dict[str, Callable[[], int]] = {
        "flat": lambda: flat(ch, rows, cap),
        "regions-64": lambda: regions(ch, rows, cap, 64, False),
        "regions-64+meta": lambda: regions(ch, rows, cap, 64, True),
        "regions-256+meta": lambda: regions(ch, rows, cap, 256, True),
        "two-level": lambda: two_level(ch, rows, cap),
        "segments": lambda: segments(ch, rows, cap),
        "region-bases-64": lambda: region_bases(ch, rows, cap, 64),
        "region-bases-256": lambda: region_bases(ch, rows, cap, 256),
        "ideal-one-rebase": lambda: ideal_one_rebase(ch, rows, cap),
    }
    ratios = {}
    for name, fn in layouts.items():
        ratios[name] = round(intervals * (full + DENSE) / fn(), 2)
        log(f"  {name:18s} P3 ratio {ratios[name]:6.2f}")
    union = np.zeros(rows, bool)
    for c in ch:
        union[c] = True
    return {"id": "P3.layout_simulation", "rows": rows, "row_bytes": ROW_BYTES, "intervals": intervals, "cap": cap,
            "union_fraction": round(float(union.mean()), 4), "ratios": ratios, "goal": 17,
            "notes": "bytes each row-delta layout would write on P3's change sets (simulated, nothing written); "
                     "ratio = intervals x (table + dense) / bytes written, as P3.full_over_written."}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--intervals", type=int, default=20)
    ap.add_argument("--cap", type=float, nargs="+", default=[0.08, 0.25])
    ap.add_argument("--json", help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    results = []
    for cap in args.cap:
        print(f"cap {cap}:")
        results.append(simulate(args.rows, args.intervals, cap))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"suite": "rowdelta_designs", "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

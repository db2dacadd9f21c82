"""P3 (row deltas, issue 3): re-saving an embedding table in which a Zipf-distributed 1% of the rows changed.

`P3.full_over_written` = bytes of a full save / bytes luopan wrote per interval save. Goal >= 6 (Check-N-Run
reports 6-17x for recommendation-model embedding tables).

**State.** ``{"emb.weight": (N, W) fp32, "dense.weight": (512, 512) fp32}``, NumPy only, seeded
(``np.random.default_rng(seed)``), random normal, so nothing compresses or deduplicates by accident. The table is
``size_mib`` MiB (512 for the real run; ``--quick`` passes a smaller size) with ``W = row_width`` (default 128, i.e.
512-byte rows), ``N = size_mib MiB / (4 W)`` rows. The dense layer is 1 MiB.

**Change model.** Row popularity follows Zipf: the row of rank r has weight ``p_r ∝ 1 / r**s`` (``s = zipf_s``,
default 1.1), and ranks are assigned to rows through a seeded random permutation, so hot rows are scattered over the
table (never contiguous; every 4 MiB chunk holds some). Each interval draws exactly ``k = round(change_fraction *
N)`` (default 1%) *distinct* rows with these weights: the Gumbel-top-k trick (the k largest of ``log p_r + Gumbel
noise``, found with ``argpartition``, O(N)) samples k rows without replacement, successively proportional to
``p`` -- the same distribution as ``rng.choice(N, k, replace=False, p=p)``, which is far too slow at N = 1M. The
chosen rows get ``0.01 * standard_normal`` added (a sparse optimizer step; every chosen row really changes); the
dense layer is rewritten entirely (``standard_normal``).

**Method.** One process, one evolving state, three repositories saved in lockstep, so all three see exactly the
same sequence of states:

* ``off``: ``luopan.open(path, delta_policy=luopan.DeltaPolicy(enabled=False))`` -- chunk-level dedup only.
  Expected ~1x: with 4 MiB chunks (8192 rows of 512 B) and 1% scattered changes, every chunk holds ~80 changed
  rows, so every chunk is new.
* ``hint``: default policy, and each interval save passes ``touched_rows={"emb.weight": rows}`` with exactly the
  rows changed since the previous save (skips detection).
* ``auto``: default policy, no hint: luopan detects the changed rows itself. **This is the mode the goal is judged
  on.** With lazy tracking the first interval in which the table changes is still written in full (per-row digests
  start from then on); that full write is counted, not excluded (``ratio_steady`` leaves it out, as context).

Step 0 is the initial full save of each repository (not counted in the ratio); then ``intervals`` interval saves
(default 20), the order of the three repositories rotating each interval. Each save is timed (``repo.save`` including
its fsyncs; ``os.sync()`` before, GC paused during), and ``info.stored_bytes`` (bytes of pack files the save
wrote) recorded, as is the growth of the repository directory on disk (packs + manifests + indexes: a cross-check).

    full_bytes = stored_bytes of the step-0 save (of the same repository)
    ratio      = intervals * full_bytes / sum(stored_bytes of the interval saves)

``ratio_by_state_nbytes`` uses the state's raw nbytes instead of ``full_bytes``; ``ratio_by_disk_growth`` uses the
directory growth in both numerator and denominator. ``ideal_ratio`` is full_bytes over what a perfect row delta
would cost (changed rows * (row bytes + an 8-byte index) + the dense layer), for scale. ``table_rewrites`` counts
interval saves whose stored_bytes exceed 50% of the table (lazy-tracking first write + rebases).

**Correctness.** At the end every repository's last step -- and a middle step, kept as an in-memory copy -- is
loaded and compared byte for byte (``np.array_equal`` on uint8 views) with what was saved; a mismatch raises.
The load time of the last step and of step 0 (a full checkpoint) is reported per mode (warm page cache).

Disk: about ``(intervals + 5) * size_mib`` MiB free in ``work`` (the ``off`` repository stores every interval in
full; the other two store a few full tables plus patches). Everything is removed at the end. Memory: the state plus two copies.

``sweep_rebase`` runs the ``auto`` mode for several ``DeltaPolicy.rebase_fraction`` values in lockstep and reports
the ratio, rewrites, save time and last-step load time for each (used to choose the default; not a goal).

    .venv/bin/python benchmarks/rowdelta.py --size-mib 64 --intervals 20 [--sweep] [--json OUT]
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from common import settle, spread, timed

TABLE = "emb.weight"
DENSE = "dense.weight"
RUN = "emb"
REWRITE_FRACTION = 0.5  # an interval save storing more than this share of the table counts as a table rewrite


# -- the evolving state ----------------------------------------------------------------------------------------
class ZipfTable:
    """An embedding table plus a small dense layer; ``step()`` changes a Zipf-chosen set of scattered rows."""

    def __init__(self, size_mib: int, row_width: int = 128, zipf_s: float = 1.1, change_fraction: float = 0.01,
                 seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.rows = max(1, (size_mib << 20) // (row_width * 4))
        self.row_width = row_width
        self.row_bytes = row_width * 4
        self.k = max(1, min(self.rows, round(change_fraction * self.rows)))
        table = self.rng.standard_normal((self.rows, row_width), dtype=np.float32)
        dense = self.rng.standard_normal((512, 512), dtype=np.float32)
        self.state: dict[str, np.ndarray] = {TABLE: table, DENSE: dense}
        # log-weight of each row: rank r (1-based) -> row perm[r-1], weight r**-s
        perm = self.rng.permutation(self.rows)
        self.logw = np.empty(self.rows, dtype=np.float64)
        self.logw[perm] = -zipf_s * np.log(np.arange(1, self.rows + 1, dtype=np.float64))
        self.hottest = int(perm[0])
        self.touched = np.zeros(self.rows, dtype=bool)  # union of rows changed so far

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())

    def sample(self) -> np.ndarray:
        """k distinct rows, sampled without replacement with weights p (Gumbel-top-k), sorted."""
        keys = self.logw + self.rng.gumbel(size=self.rows)
        if self.k == self.rows:
            return np.arange(self.rows, dtype=np.int64)
        idx = np.argpartition(keys, self.rows - self.k)[self.rows - self.k:]
        return np.sort(idx).astype(np.int64)

    def step(self) -> np.ndarray:
        idx = self.sample()
        table = self.state[TABLE]
        table[idx] += np.float32(0.01) * self.rng.standard_normal((idx.size, self.row_width), dtype=np.float32)
        self.rng.standard_normal(dtype=np.float32, out=self.state[DENSE])
        self.touched[idx] = True
        return idx

    def snapshot(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.state.items()}


# -- luopan feature detection ----------------------------------------------------------------------------------
def _features() -> dict[str, bool]:
    import luopan

    return {
        "delta_policy": hasattr(luopan, "DeltaPolicy")
        and "delta_policy" in inspect.signature(luopan.open).parameters,
        "touched_rows": "touched_rows" in inspect.signature(luopan.Repo.save).parameters,
    }


def _open(path: str, policy: dict[str, Any] | None) -> Any:
    """luopan.open with DeltaPolicy(**policy) where row deltas exist; a plain open (chunk dedup) otherwise."""
    import luopan

    if policy is not None and _features()["delta_policy"]:
        return luopan.open(path, delta_policy=luopan.DeltaPolicy(**policy))
    return luopan.open(path)


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # a temporary that went away
                pass
    return total


def _same_bytes(a: np.ndarray, b: Any) -> bool:
    b = np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def _check(repo: Any, step: int, expected: dict[str, np.ndarray], label: str) -> None:
    got = repo.load(RUN, step)
    bad = [k for k in expected if k not in got or not _same_bytes(expected[k], got[k])]
    extra = sorted(set(got) - set(expected))
    if bad or extra:
        raise RuntimeError(f"P3 [{label}]: repo.load({RUN!r}, {step}) differs from the saved state: "
                           f"mismatched {bad}, unexpected {extra}")


# -- the lockstep driver ---------------------------------------------------------------------------------------
class _Mode:
    def __init__(self, name: str, path: str, policy: dict[str, Any] | None, hint: bool) -> None:
        self.name, self.path, self.policy, self.hint = name, path, policy, hint
        self.repo = _open(path, policy)
        self.full_stored = 0
        self.full_disk = 0
        self.full_s = 0.0
        self.stored: list[int] = []
        self.new: list[int] = []
        self.disk: list[int] = []
        self.save_s: list[float] = []
        self.load_last_s: list[float] = []
        self.load_first_s: list[float] = []


def _drive(modes: list[_Mode], gen: ZipfTable, intervals: int, log: Callable[..., Any], tag: str,
           hint_ok: bool) -> dict[str, Any]:
    """Step 0 + ``intervals`` interval saves into every mode's repository, in lockstep on one evolving state."""
    for m in modes:
        settle()
        m.full_s, info = timed(lambda: m.repo.save(RUN, 0, gen.state))
        m.full_stored = info.stored_bytes
        m.full_disk = _dir_bytes(m.path)
    log(f"  {tag} step 0 (full): " + ", ".join(
        f"{m.name} {m.full_stored / (1 << 20):.1f} MiB in {m.full_s:.2f}s" for m in modes))
    mid = max(1, intervals // 2)
    mid_state: dict[str, np.ndarray] | None = None
    changed: list[int] = []
    union: list[int] = []
    for step in range(1, intervals + 1):
        idx = gen.step()
        changed.append(int(idx.size))
        union.append(int(gen.touched.sum()))
        if step == mid:
            mid_state = gen.snapshot()
        rot = step % len(modes)
        parts = []
        for m in modes[rot:] + modes[:rot]:
            kwargs = {"touched_rows": {TABLE: idx}} if (m.hint and hint_ok) else {}
            before = _dir_bytes(m.path)
            settle()
            dt, info = timed(lambda: m.repo.save(RUN, step, gen.state, **kwargs))
            m.save_s.append(dt)
            m.stored.append(info.stored_bytes)
            m.new.append(info.new_bytes)
            m.disk.append(_dir_bytes(m.path) - before)
            parts.append(f"{m.name} {info.stored_bytes / (1 << 20):.2f} MiB {dt:.3f}s")
        log(f"  {tag} interval {step}/{intervals} ({idx.size} rows, union {union[-1]}): " + ", ".join(parts))
    assert mid_state is not None
    for m in modes:
        for _ in range(2):  # warm page cache; the first pass also reads the data in
            dt, _state = timed(lambda: m.repo.load(RUN, intervals))
            m.load_last_s.append(dt)
            del _state
            dt, _state = timed(lambda: m.repo.load(RUN, 0))
            m.load_first_s.append(dt)
            del _state
        _check(m.repo, intervals, gen.state, m.name)
        _check(m.repo, mid, mid_state, m.name)
    log(f"  {tag} verified: steps {mid} and {intervals} of every repository load back byte for byte")
    return {"changed_rows": changed, "union_rows": union, "verified_steps": [mid, intervals]}


def _summary(m: _Mode, gen: ZipfTable, intervals: int) -> dict[str, Any]:
    table_bytes = gen.state[TABLE].nbytes
    written = sum(m.stored)
    rewrites = [i + 1 for i, b in enumerate(m.stored) if b > REWRITE_FRACTION * table_bytes]
    steady = m.stored[1:]
    return {
        "ratio": intervals * m.full_stored / written if written else float("inf"),
        "ratio_steady": (len(steady) * m.full_stored / sum(steady)) if steady and sum(steady) else None,
        "ratio_by_state_nbytes": intervals * gen.nbytes / written if written else float("inf"),
        "ratio_by_disk_growth": intervals * m.full_disk / sum(m.disk) if sum(m.disk) else float("inf"),
        "full_stored_bytes": m.full_stored,
        "full_save_s": m.full_s,
        "interval_stored_bytes": m.stored,
        "interval_new_bytes": m.new,
        "interval_disk_growth_bytes": m.disk,
        "mean_stored_bytes": written / intervals,
        "mean_save_s": sum(m.save_s) / len(m.save_s),
        "save_spread": spread(m.save_s),
        "table_rewrites": len(rewrites),
        "table_rewrite_intervals": rewrites,
        "load_last_s": min(m.load_last_s[1:]),
        "load_step0_s": min(m.load_first_s[1:]),
    }


# -- P3 --------------------------------------------------------------------------------------------------------
def run_p3(size_mib: int, intervals: int, work: str, log: Callable[..., Any], *, row_width: int = 128,
           zipf_s: float = 1.1, change_fraction: float = 0.01, seed: int = 0) -> list[dict[str, Any]]:
    """P3.full_over_written: see the module docstring. ``work`` is a scratch directory (subdirectories are made
    there and removed at the end); ``log`` a print-like callable. Returns one result dict."""
    feats = _features()
    if not feats["delta_policy"]:
        log("  P3: this luopan has no DeltaPolicy (row deltas): all three modes are chunk dedup only")
    if size_mib < 16:
        log(f"  P3: a {size_mib} MiB table is below DeltaPolicy's default min_bytes (16 MiB): no row deltas")
    base = os.path.join(work, "p3")
    os.makedirs(base, exist_ok=False)
    try:
        t0 = time.perf_counter()
        gen = ZipfTable(size_mib, row_width, zipf_s, change_fraction, seed)
        log(f"  P3: table {gen.rows} x {row_width} fp32 ({gen.state[TABLE].nbytes / (1 << 20):.0f} MiB), "
            f"{gen.k} rows ({change_fraction:.1%}) change per interval, Zipf s={zipf_s}, {intervals} intervals")
        modes = [
            _Mode("off", os.path.join(base, "off"), {"enabled": False}, hint=False),
            _Mode("hint", os.path.join(base, "hint"), None, hint=True),
            _Mode("auto", os.path.join(base, "auto"), None, hint=False),
        ]
        trace = _drive(modes, gen, intervals, log, "P3", feats["touched_rows"])
        for m in modes:
            m.repo.close()
        s = {m.name: _summary(m, gen, intervals) for m in modes}
        auto = s["auto"]
        table_bytes = gen.state[TABLE].nbytes
        dense_bytes = gen.state[DENSE].nbytes
        ideal = sum(c * (gen.row_bytes + 8) for c in trace["changed_rows"]) + intervals * dense_bytes
        ratio = auto["ratio"]
        result = {
            "id": "P3.full_over_written",
            "ratio": round(ratio, 3),
            "value": round(ratio, 3),
            "goal": 6,
            "goal_op": ">=",
            "met": ratio >= 6,
            "luopan_mode": "default DeltaPolicy, automatic row-change detection (no touched_rows hint)",
            "row_deltas_available": feats["delta_policy"],
            "touched_rows_available": feats["touched_rows"],
            "ratio_steady": _round(auto["ratio_steady"]),
            "ratio_by_state_nbytes": _round(auto["ratio_by_state_nbytes"]),
            "ratio_by_disk_growth": _round(auto["ratio_by_disk_growth"]),
            "ratio_hint_mode": _round(s["hint"]["ratio"]),
            "ratio_deltas_off": _round(s["off"]["ratio"]),
            "ideal_ratio": _round(intervals * auto["full_stored_bytes"] / ideal),
            "full_stored_bytes": auto["full_stored_bytes"],
            "state_bytes": gen.nbytes,
            "table_bytes": table_bytes,
            "dense_bytes": dense_bytes,
            "table_rows": gen.rows,
            "row_bytes": gen.row_bytes,
            "changed_rows_per_interval": gen.k,
            "changed_rows_union": trace["union_rows"][-1],
            "changed_rows_union_fraction": round(trace["union_rows"][-1] / gen.rows, 4),
            "changed_rows_union_by_interval": trace["union_rows"],
            "intervals": intervals,
            "zipf_s": zipf_s,
            "seed": seed,
            "table_rewrites": auto["table_rewrites"],
            "table_rewrites_hint_mode": s["hint"]["table_rewrites"],
            "luopan_s": auto["mean_save_s"],
            "mean_save_s": {k: v["mean_save_s"] for k, v in s.items()},
            "full_save_s": {k: v["full_save_s"] for k, v in s.items()},
            "load_last_s": {k: v["load_last_s"] for k, v in s.items()},
            "load_step0_s": {k: v["load_step0_s"] for k, v in s.items()},
            "modes": s,
            "verified_steps": trace["verified_steps"],
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "notes": "ratio = intervals * stored bytes of the step-0 full save / stored bytes of the interval saves "
                     "(pack files), auto-detected row deltas; a Zipf(s) 1% of rows, scattered by a random "
                     "permutation, changes per interval and a 1 MiB dense layer is rewritten. Peers in the same "
                     "run on the same states: ratio_deltas_off (chunk dedup only), ratio_hint_mode "
                     "(touched_rows). table_rewrites = interval saves storing > 50% of the table (the lazy "
                     "first write + rebases). Last and middle steps verified byte for byte."
                     + ("" if feats["delta_policy"] else " This luopan has no row deltas: all modes are chunk "
                                                           "dedup."),
        }
        log(f"  P3: ratio {ratio:.2f} (auto), {s['hint']['ratio']:.2f} (touched_rows hint), "
            f"{s['off']['ratio']:.2f} (deltas off); ideal {result['ideal_ratio']}; table rewrites "
            f"{auto['table_rewrite_intervals']}; union of changed rows {trace['union_rows'][-1]} "
            f"({result['changed_rows_union_fraction']:.1%})")
        return [result]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def sweep_rebase(size_mib: int, intervals: int, work: str, log: Callable[..., Any],
                 fractions: tuple[float, ...] = (0.1, 0.25, 0.5), *, row_width: int = 128, zipf_s: float = 1.1,
                 change_fraction: float = 0.01, seed: int = 0) -> list[dict[str, Any]]:
    """For each DeltaPolicy(rebase_fraction=f): ratio (as P3, auto detection), table rewrites, mean save time and
    the load time of the last step (warm cache; step 0, a full checkpoint, for reference). One repository per
    fraction, saved in lockstep on the same states. Context for choosing the default, not a goal."""
    feats = _features()
    if not feats["delta_policy"]:
        log("  sweep: this luopan has no DeltaPolicy: every fraction is the same chunk-dedup save")
    base = os.path.join(work, "p3-sweep")
    os.makedirs(base, exist_ok=False)
    try:
        gen = ZipfTable(size_mib, row_width, zipf_s, change_fraction, seed)
        modes = [_Mode(f"f={f:g}", os.path.join(base, f"f{i}"), {"rebase_fraction": f}, hint=False)
                 for i, f in enumerate(fractions)]
        trace = _drive(modes, gen, intervals, log, "sweep", feats["touched_rows"])
        out = []
        for f, m in zip(fractions, modes):
            m.repo.close()
            s = _summary(m, gen, intervals)
            out.append({"rebase_fraction": f, "ratio": _round(s["ratio"]), "ratio_steady": _round(s["ratio_steady"]),
                        "table_rewrites": s["table_rewrites"], "table_rewrite_intervals": s["table_rewrite_intervals"],
                        "mean_save_s": s["mean_save_s"], "load_last_s": s["load_last_s"],
                        "load_step0_s": s["load_step0_s"], "mean_stored_bytes": s["mean_stored_bytes"],
                        "changed_rows_union": trace["union_rows"][-1], "row_deltas_available": feats["delta_policy"],
                        "size_mib": size_mib, "intervals": intervals})
            log(f"  sweep rebase_fraction={f:g}: ratio {s['ratio']:.2f}, rewrites {s['table_rewrite_intervals']}, "
                f"mean save {s['mean_save_s']:.3f}s, load last {s['load_last_s']:.3f}s "
                f"(step 0: {s['load_step0_s']:.3f}s)")
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys
    import tempfile

    ap = argparse.ArgumentParser(description="P3 row-delta benchmark (see the module docstring)")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--intervals", type=int, default=20)
    ap.add_argument("--row-width", type=int, default=128)
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--sweep", action="store_true", help="also run sweep_rebase")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--workdir", help="parent of the scratch directory (default: the system temp dir)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    work = tempfile.mkdtemp(prefix="luopan-bench-p3-", dir=args.workdir)
    try:
        report: dict[str, Any] = {"results": run_p3(args.size_mib, args.intervals, work, log,
                                                    row_width=args.row_width, zipf_s=args.zipf_s)}
        if args.sweep:
            report["sweep_rebase"] = sweep_rebase(args.size_mib, args.intervals, work, log, tuple(args.fractions),
                                                  row_width=args.row_width, zipf_s=args.zipf_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = report["results"][0]
    print(f"{r['id']}: {r['ratio']} (goal {r['goal_op']} {r['goal']}: {'met' if r['met'] else 'MISSED'}); "
          f"hint mode {r['ratio_hint_mode']}, deltas off {r['ratio_deltas_off']}, ideal {r['ideal_ratio']}; "
          f"mean save s {r['mean_save_s']}; table rewrites {r['table_rewrites']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    import sys

    HERE = os.path.dirname(os.path.abspath(__file__))
    try:
        import luopan  # noqa: F401
    except ImportError:  # a checkout without an installed luopan
        sys.path.insert(1, os.path.join(os.path.dirname(HERE), "src"))
    sys.exit(main())

"""Row tables of a snapshot (docs/format.md §17.7): the row-structured arrays of a decomposed index (a flat index's
codes with its IDMap's id map, an id map alone, the user's ``ids``, the rows of an IVF's lists) and how a snapshot
stores each: as before (extents; IVF segments) while it only grew, or as a **row map** — a pool that only grows plus
runs naming the live rows — once rows were removed or moved, so a ``remove_ids`` costs what changed.

Per table and snapshot, against the live version's manifest:

* a row map there whose live bytes (XXH3-128) are the current table's first rows (flat) or each list's first
  entries (IVF): the pool keeps its chunks as they are, the new rows are appended, the runs extended (nothing read);
* else, when the current table is not the previous one plus appended rows: the previous pool (or plain entries) is
  read and verified, each live row is matched to a pool row with the same bytes, unmatched rows are appended;
* a pool more than half dead, or runs larger than a quarter of the live bytes: the table is cut fresh, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LuopanError
from ..format.manifest import Row
from ..store.base import Store
from .extents import Appended, Gathered, as_bytes, read_into
from .ivf import arrays as ivf_arrays
from .ivf import plan_segments, segment_views
from .manifest import IDS
from .rowmap import column_rows, compress, digest, expand, match

RUN_BYTES = 16
CHUNK_SLACK = 64  # pool chunk rows allowed beyond twice the fresh count before a table is cut fresh

Item = tuple[str, Any, str, list[int]]


@dataclass
class Column:
    path: str
    dtype: str
    trailing: list[int]  # the shape after the row dimension

    @property
    def width(self) -> int:
        return math.prod(self.trailing) * np.dtype(self.dtype).itemsize


@dataclass
class Table:
    columns: list[Column]
    live: list[Gathered]  # per column, the live bytes (views of faiss memory)
    rows: int
    lists: Any = None  # faiss_codec.Lists of an IVF node
    sizes: np.ndarray | None = None  # entries per list (IVF)

    @property
    def runs_path(self) -> str:
        return self.columns[0].path + ".runs"

    @property
    def paths(self) -> list[str]:
        return [c.path for c in self.columns]


@dataclass
class Planned:
    arrays: list[Item]
    rowmap: dict[str, Any] | None = None
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)  # extent reuse by path, beyond same-path rows


def _column(path: str, arr: Any, dtype: str, shape: list[int]) -> tuple[Column, Gathered]:
    data = arr if isinstance(arr, Gathered) else Gathered([as_bytes(arr)])
    return Column(path, dtype, list(shape[1:])), data


def split(arrays: list[Item], ivfs: list[Any]) -> tuple[list[Item], list[Table]]:
    """The plain arrays (skeleton, HNSW graphs and storage) and the row tables of a decomposed index."""
    by_path = {a[0]: a for a in arrays}
    plain: list[Item] = []
    tables: list[Table] = []
    grouped: set[str] = set()
    for path, arr, dtype, shape in arrays:
        parts = path.split("/")
        if path in grouped or "hnsw" in parts or "storage" in parts or parts[-1] not in ("codes", "id_map", IDS):
            if path not in grouped:
                plain.append((path, arr, dtype, shape))
            continue
        cols = [(path, arr, dtype, shape)]
        if path.endswith("index/codes") and path[:-len("index/codes")] + "id_map" in by_path:
            sibling = by_path[path[:-len("index/codes")] + "id_map"]
            cols.append(sibling)
            grouped.add(sibling[0])
        made = [_column(*c) for c in cols]
        tables.append(Table([c for c, _g in made], [g for _c, g in made], shape[0]))
    for lists in ivfs:
        sizes = np.array([len(i) for i in lists.ids], dtype=np.int64)
        codes, ids, m = segment_views(lists, sizes[None, :])[0]
        p = lists.prefix + "ivf/0/"
        tables.append(Table([Column(p + "codes", "uint8", [lists.code_size]), Column(p + "ids", "int64", [])],
                            [codes, ids], m, lists, sizes))
    return plain, tables


class Previous:
    """The live version's manifest, as the tables read it (its entries raw, never assembled)."""

    def __init__(self, doc: dict[str, Any] | None, store: Store, owner: str) -> None:
        self.doc, self.store, self.owner = doc, store, owner
        self.entries = {e["path"]: e for e in doc["entries"]} if doc else {}

    def read(self, path: str) -> np.ndarray:
        e = self.entries[path]
        out = np.empty(e["shape"], dtype=e["dtype"])
        read_into(self.store, self.owner, self.doc, [(e, out)])  # type: ignore[arg-type]
        return out

    def rowmap(self, t: Table) -> dict[str, Any] | None:
        for rm in (self.doc or {}).get("rowmaps", []):
            if rm["columns"] == t.paths:
                return rm
        return None

    def fits(self, t: Table, paths: list[str]) -> bool:
        return all(p in self.entries and self.entries[p]["dtype"] == c.dtype
                   and self.entries[p]["shape"][1:] == c.trailing for p, c in zip(paths, t.columns))


def _intact(rows: list[list[Any]], buf: Gathered) -> bool:
    off = 0
    for raw in rows:
        r = Row._make(raw)
        if off + r.size > len(buf) or buf.xxh3(off, r.size) != r.xxh3:
            return False
        off += r.size
    return True


def _recut(pool_rows: int, t: Table, runs: np.ndarray) -> bool:
    live_bytes = t.rows * sum(c.width for c in t.columns)
    return pool_rows > 2 * t.rows + 64 or len(runs) * RUN_BYTES > live_bytes // 4 + 4096


def _plain(t: Table, prev_counts: np.ndarray | None) -> Planned:
    if t.lists is None:
        return Planned([(c.path, g, c.dtype, [t.rows, *c.trailing]) for c, g in zip(t.columns, t.live)])
    assert t.sizes is not None
    return Planned(ivf_arrays(t.lists, plan_segments(t.sizes, prev_counts)))


def _finish(t: Table, cols: list[Any], pool_rows: int, runs: np.ndarray, previous: dict[str, Any]) -> Planned:
    arrays: list[Item] = [(c.path, data, c.dtype, [pool_rows, *c.trailing]) for c, data in zip(t.columns, cols)]
    arrays.append((t.runs_path, runs, "int64", [len(runs), 2]))
    if t.sizes is not None:
        arrays.insert(0, (t.lists.prefix + "ivf/counts", t.sizes[None, :], "int64", [1, len(t.sizes)]))
    rowmap = {"columns": t.paths, "runs": t.runs_path, "rows": t.rows, "xxh3": digest(t.live)}
    return Planned(arrays, rowmap, previous)


def _general(t: Table, pool: list[np.ndarray], previous: dict[str, Any]) -> Planned | None:
    """Match every live row to a pool row with its bytes; the others are appended to the pool."""
    m = len(pool[0])
    pool_cols = [column_rows(a, m) for a in pool]
    live_cols = [column_rows(g, t.rows) for g in t.live]
    idx = match(pool_cols, live_cols)
    fresh = np.flatnonzero(idx < 0)
    idx[fresh] = m + np.arange(len(fresh))
    runs = compress(idx)
    if _recut(m + len(fresh), t, runs):
        return None
    cols = [Gathered([as_bytes(arr), as_bytes(live[fresh])]) for arr, live in zip(pool, live_cols)]
    return _finish(t, cols, m + len(fresh), runs, previous)


def _extended(t: Table, prev: Previous, rm: dict[str, Any], sizes0: np.ndarray | None,
              reusable: Callable[[str], bool], chunk: int) -> Planned | None:
    """The previous row map's live rows still lead the table (each list): append the rest, read nothing."""
    n0, pool_rows = rm["rows"], prev.entries[t.paths[0]]["shape"][0]
    if t.sizes is None:
        if t.rows < n0:
            return None
        head = [Gathered([g.view(0, n0 * c.width)]) if n0 else Gathered([]) for c, g in zip(t.columns, t.live)]
        tails = [Gathered([g.view(n0 * c.width, (t.rows - n0) * c.width)]) if t.rows > n0 else Gathered([])
                 for c, g in zip(t.columns, t.live)]
    else:
        if sizes0 is None or len(sizes0) != len(t.sizes) or bool((t.sizes < sizes0).any()):
            return None
        (hc, hi, _m0), (tc, ti, _mt) = segment_views(t.lists, np.vstack([sizes0, t.sizes - sizes0]))
        head, tails = [hc, hi], [tc, ti]
    if digest(head) != rm["xxh3"]:
        return None
    rows = [prev.entries[p]["chunks"] for p in t.paths]
    fresh_chunks = max(1, -(-pool_rows * sum(c.width for c in t.columns) // chunk))
    if not all(reusable(Row._make(r).hash) for col in rows for r in col) or \
            max(len(col) for col in rows) > 2 * fresh_chunks + CHUNK_SLACK:
        return None
    idx0 = expand(prev.read(rm["runs"]))
    nt = t.rows - n0
    if t.sizes is None:
        idx = np.concatenate([idx0, pool_rows + np.arange(nt, dtype=np.int64)])
    else:
        idx = _insert_tails(idx0, sizes0, t.sizes, pool_rows)
    runs = compress(idx)
    if _recut(pool_rows + nt, t, runs):
        return None
    return _finish(t, [Appended(r, g) for r, g in zip(rows, tails)], pool_rows + nt, runs, {})


def _insert_tails(idx0: np.ndarray, sizes0: np.ndarray, sizes: np.ndarray, pool_rows: int) -> np.ndarray:
    """Per-row pool indices of lists that grew: each list's old rows, then its tail (appended to the pool in list
    order)."""
    nlist = len(sizes)
    tail = sizes - sizes0
    start1 = np.cumsum(sizes) - sizes
    idx = np.empty(int(sizes.sum()), dtype=np.int64)
    lid0 = np.repeat(np.arange(nlist), sizes0)
    idx[start1[lid0] + np.arange(len(idx0)) - (np.cumsum(sizes0) - sizes0)[lid0]] = idx0
    nt = int(tail.sum())
    lidt = np.repeat(np.arange(nlist), tail)
    offt = np.arange(nt) - (np.cumsum(tail) - tail)[lidt]
    idx[start1[lidt] + sizes0[lidt] + offt] = pool_rows + np.arange(nt)
    return idx


def plan_table(t: Table, prev: Previous, reusable: Callable[[str], bool], chunk: int, rowmaps: bool = True
               ) -> Planned:
    """How this snapshot stores table ``t`` (see the module docstring); without ``rowmaps`` (a repository whose
    config is older than format 8) as before: extents, IVF segments. A previous version that cannot be read (a
    damaged chunk) is no base: the table is cut fresh from the index in memory."""
    try:
        return _plan(t, prev, reusable, chunk, rowmaps)
    except LuopanError:
        return _plain(t, None)


def _plan(t: Table, prev: Previous, reusable: Callable[[str], bool], chunk: int, rowmaps: bool) -> Planned:
    rm = prev.rowmap(t)
    counts_path = t.lists.prefix + "ivf/counts" if t.lists is not None else None
    if not rowmaps:
        counts0 = prev.read(counts_path) if counts_path in prev.entries and rm is None else None
        return _plain(t, counts0)
    if rm is not None and prev.fits(t, t.paths):
        sizes0 = None
        if counts_path is not None and counts_path in prev.entries:
            sizes0 = prev.read(counts_path).sum(axis=0)
        got = _extended(t, prev, rm, sizes0, reusable, chunk)
        if got is None:
            got = _general(t, [prev.read(p) for p in t.paths], {})
        return got or _plain(t, None)
    if counts_path is None:
        if not prev.fits(t, t.paths) or all(_intact(prev.entries[p]["chunks"], g) for p, g in zip(t.paths, t.live)):
            return _plain(t, None)
        return _general(t, [prev.read(p) for p in t.paths], {}) or _plain(t, None)
    # an IVF stored as segments: still the previous segments plus tails -> segments, as before
    counts0 = prev.read(counts_path) if counts_path in prev.entries else None
    if counts0 is None or counts0.ndim != 2 or counts0.shape[1] != len(t.sizes):
        return _plain(t, None)
    segs = [(f"{t.lists.prefix}ivf/{k}/codes", f"{t.lists.prefix}ivf/{k}/ids") for k in range(len(counts0))]
    seg_cols = [Column(p, c.dtype, c.trailing) for p, c in zip(segs[0], t.columns)]
    if not all(prev.fits(Table(seg_cols, [], 0), list(s)) for s in segs):
        return _plain(t, counts0)
    if not bool((t.sizes < counts0.sum(axis=0)).any()):
        views = segment_views(t.lists, counts0)
        if all(_intact(prev.entries[s[0]]["chunks"], v[0]) and _intact(prev.entries[s[1]]["chunks"], v[1])
               for s, v in zip(segs, views)):
            return _plain(t, counts0)
    pool = [np.concatenate([prev.read(s[j]) for s in segs]) for j in range(2)]
    previous = {p: {"chunks": [r for s in segs for r in prev.entries[s[j]]["chunks"]]} for j, p in enumerate(t.paths)}
    return _general(t, pool, previous) or _plain(t, counts0)

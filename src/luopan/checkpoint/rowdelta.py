"""Row deltas (docs/format.md §5.2): a large, sparsely updated table stored as base chunks + changed rows.

An entry with at least two dimensions is a table of ``shape[0]`` rows of ``nbytes // shape[0]`` bytes. When only a
few rows changed, the manifest lists the chunks of one earlier full version of the entry (its *base*) and the rows
that differ from it: their indices (sorted int64) and values. The patch is always against the base, never against
another patch (depth 1), so loading reads the base chunks and the patch, and nothing else. When the patch grows past
``rebase_fraction`` of the table, the entry is written in full again and becomes the new base.

Detection: per-chunk XXH3 (computed anyway) finds the chunks that changed since the previous save; within those,
per-row XXH3-128 digests are compared with the digests of the previous save's rows, which this process keeps in
memory (16 bytes per row). Rows whose digest moved are added to the patch. Digests are only computed for a table
once it has changed after its first save in this process, so frozen tables cost nothing, and that first change is
written in full (it becomes the base). A training loop that knows which rows it touched can say so
(``touched_rows=``), which skips the row digests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptManifestError, UnsupportedValueError, UsageError
from ..tree import Leaf

_EMPTY = np.empty(0, dtype=np.int64)
MAX_BACKOFF = 32  # saves without detection after a table was found densely updated (doubling from 1)


@dataclass(frozen=True)
class DeltaPolicy:
    """When to store large tables as row deltas.

    ``min_bytes``: tables (tensors with >= 2 dimensions) at least this large are candidates.
    ``rebase_fraction``: the entry is written in full (and becomes the new base) once its patch (values + 8-byte
    indices) would exceed this fraction of its size (a cap on load work: a restore reads base + patch, so 0.08
    keeps it within ~1.1x of a full checkpoint's), or earlier, once another delta would raise the average bytes
    written per save since the base (docs/format.md §5.2, benchmarks P3 and P4).
    ``enabled=False`` stores every entry as plain chunks.
    """

    enabled: bool = True
    min_bytes: int = 16 << 20
    rebase_fraction: float = 0.08

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or self.min_bytes < 1:
            raise UsageError(f"DeltaPolicy.min_bytes must be a positive int, got {self.min_bytes!r}")
        if not (isinstance(self.rebase_fraction, (int, float)) and 0 < self.rebase_fraction < 1):
            raise UsageError(f"DeltaPolicy.rebase_fraction must be between 0 and 1, got {self.rebase_fraction!r}")

    def eligible(self, leaf: Leaf) -> bool:
        return (self.enabled and leaf.alias_of is None and not leaf.scalar and len(leaf.shape) >= 2
                and leaf.shape[0] >= 2 and leaf.nbytes >= self.min_bytes)


@dataclass(frozen=True)
class RowTrack:
    """What this process knows about one table entry after a committed save (per run, per entry path)."""

    layout: tuple[Any, ...]  # (kind, dtype, shape): a track only applies to the same layout
    xxh: tuple[str, ...]  # XXH3-128 of each chunk of the content that save stored
    digests: RowDigests | None  # row (and row-block) digests of that content; None: not tracked
    base_step: int  # the step whose full version is the base
    base_chunks: list[list[Any]] | None  # that version's manifest chunk rows (set once the save commits)
    patch: np.ndarray  # sorted row numbers differing from the base (empty: the entry is stored in full)
    skip: int = 0  # saves left without row detection (backoff after dense updates)
    backoff: int = 0
    cycle_bytes: int = 0  # bytes written for this entry since (and including) its base
    cycle_saves: int = 0  # saves since (and including) the base


@dataclass
class Decision:
    """The save pipeline's plan for one table entry."""

    track: RowTrack  # the entry's track once this save commits (base_chunks filled in by the caller if full)
    xxh: list[str]  # chunk XXH3s of the current content (reused by the pipeline)
    delta: tuple[np.ndarray, memoryview] | None = None  # (row numbers, their values) when stored as a delta


def layout(leaf: Leaf) -> tuple[Any, ...]:
    return (leaf.kind, leaf.dtype, tuple(leaf.shape))


def row_digests(data: memoryview, row_bytes: int, rows: np.ndarray | None = None) -> np.ndarray:
    """(n, 2) uint64 XXH3-128 digests of the given sorted rows (all rows when None): ~0.4 us per row here."""
    digest = xxhash.xxh3_128_digest
    if rows is None:
        offsets: Any = range(0, len(data), row_bytes)
    elif rows.size and rows[-1] - rows[0] + 1 == rows.size:  # one run of rows (e.g. every row of a table)
        offsets = range(int(rows[0]) * row_bytes, (int(rows[-1]) + 1) * row_bytes, row_bytes)
    else:
        offsets = (rows * row_bytes).tolist()
    joined = b"".join([digest(data[o : o + row_bytes]) for o in offsets])
    return np.frombuffer(joined, dtype=np.uint64).reshape(-1, 2)


BLOCK_BYTES = 4096  # rows are first compared in blocks of about this size (see RowDigests)


@dataclass(frozen=True)
class RowDigests:
    """XXH3-128 digests of a table's rows and of blocks of ``per_block`` consecutive rows (~4 KiB).

    Detection compares blocks first and looks at rows only inside blocks that moved: hashing each of 1M 512-byte
    rows of a changed table took ~0.4 s, almost all of it per-call overhead; 131K 4 KiB blocks plus the rows of the
    few blocks that changed take a fraction of that. A block digest of all zeros is a mark meaning "look at its
    rows" (set where a touched_rows hint updated row digests without reading the whole block).
    """

    rows: np.ndarray  # (nrows, 2) uint64
    blocks: np.ndarray | None  # (nblocks, 2) uint64; None when a block is one row
    per_block: int

    @classmethod
    def of(cls, data: memoryview, row_bytes: int) -> RowDigests:
        per_block = max(1, BLOCK_BYTES // row_bytes)
        blocks = _digests(data, per_block * row_bytes) if per_block > 1 else None
        return cls(row_digests(data, row_bytes), blocks, per_block)

    def detect(self, data: memoryview, row_bytes: int, candidates: np.ndarray) -> tuple[np.ndarray, RowDigests]:
        """(rows among the sorted ``candidates`` whose bytes changed, digests of the current content)."""
        rows_d = self.rows.copy()
        blocks_d = self.blocks
        check = candidates
        if blocks_d is not None:
            k = self.per_block
            cand = np.unique(candidates // k)  # candidates are sorted: cheap
            now_b = _digests(data, k * row_bytes, cand)
            moved = cand[np.any(now_b != blocks_d[cand], axis=1)]
            blocks_d = blocks_d.copy()
            blocks_d[cand] = now_b
            check = (moved[:, None] * k + np.arange(k)[None, :]).reshape(-1)
            check = check[check < len(rows_d)]
        now = row_digests(data, row_bytes, check)
        touched = check[np.any(now != rows_d[check], axis=1)]
        rows_d[check] = now
        return touched, RowDigests(rows_d, blocks_d, self.per_block)

    def with_rows(self, data: memoryview, row_bytes: int, rows: np.ndarray) -> RowDigests:
        """Digests after ``rows`` were rewritten (touched_rows hint): their blocks are marked for a row look."""
        rows_d = self.rows.copy()
        rows_d[rows] = row_digests(data, row_bytes, rows)
        blocks_d = self.blocks
        if blocks_d is not None:
            blocks_d = blocks_d.copy()
            blocks_d[rows // self.per_block] = 0
        return RowDigests(rows_d, blocks_d, self.per_block)


def _digests(data: memoryview, span: int, which: np.ndarray | None = None) -> np.ndarray:
    """(n, 2) uint64 XXH3-128 of consecutive ``span``-byte pieces of ``data`` (the given piece numbers, or all)."""
    digest = xxhash.xxh3_128_digest
    offsets: Any = range(0, len(data), span) if which is None else (which * span).tolist()
    return np.frombuffer(b"".join([digest(data[o : o + span]) for o in offsets]), dtype=np.uint64).reshape(-1, 2)


def rows_in_spans(spans: list[tuple[int, int]], row_bytes: int, nrows: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask over rows, sorted row numbers) of the rows overlapping any of the byte spans. O(rows), no sort: a
    hash-based np.unique took 0.34 s for 512K rows."""
    mask = np.zeros(nrows, dtype=bool)
    for off, length in spans:
        mask[off // row_bytes : -(-(off + length) // row_bytes)] = True
    return mask, np.flatnonzero(mask)


def normalise_hint(path: str, rows: Any, nrows: int) -> np.ndarray:
    """A touched_rows value as sorted unique int64 row numbers; UnsupportedValueError names bad input."""
    try:
        arr = rows.detach().cpu().numpy() if hasattr(rows, "detach") else np.asarray(rows)
    except Exception as exc:  # noqa: BLE001 - anything that is not array-like
        raise UnsupportedValueError(f"touched_rows[{path!r}] must be an array of row numbers: {exc}") from None
    if arr.dtype == bool or (arr.size and arr.dtype.kind not in "iu"):
        raise UnsupportedValueError(
            f"touched_rows[{path!r}] must hold integer row numbers, got dtype {arr.dtype}; pass e.g. "
            "batch_ids.unique()")
    arr = np.unique(arr.reshape(-1).astype(np.int64, copy=False))
    if arr.size and (arr[0] < 0 or arr[-1] >= nrows):
        raise UnsupportedValueError(
            f"touched_rows[{path!r}] names row {arr[0] if arr[0] < 0 else arr[-1]}, but the table has {nrows} rows")
    return arr


def plan_table(
    leaf: Leaf,
    data: memoryview,
    spans: list[tuple[int, int]],
    step: int,
    track: RowTrack | None,
    hint: np.ndarray | None,
    policy: DeltaPolicy,
    base_usable: Callable[[list[list[Any]]], bool],
    pool: ThreadPoolExecutor,
) -> Decision:
    """Decide how to store one table entry this save: in full, or as base + patch."""
    xs = list(pool.map(xxhash.xxh3_128_hexdigest, [data[o : o + n] for o, n in spans]))
    nrows = leaf.shape[0]
    rb = leaf.nbytes // nrows
    full = RowTrack(layout(leaf), tuple(xs), None, step, None, _EMPTY)
    if track is None or track.layout != layout(leaf) or track.base_chunks is None:
        return Decision(full, xs)  # first save of this table in this process: nothing to compare with
    changed_k = [k for k, (x, old) in enumerate(zip(xs, track.xxh)) if x != old]
    changed = [spans[k] for k in changed_k]
    if not changed:  # same content as the previous save: keep its form (base + the same patch, or full)
        if track.patch.size and not base_usable(track.base_chunks):
            return Decision(full, xs)
        return Decision(track, xs, _gather(data, track.patch, rb) if track.patch.size else None)
    changed_mask, in_changed = rows_in_spans(changed, rb, nrows)
    digests = track.digests
    touched = None
    xxh_track = full.xxh
    if hint is not None:
        touched = hint[changed_mask[hint]]  # rows in unchanged chunks did not change
        if not _covers(changed, touched, rb, nrows):
            touched = None  # a chunk changed without any touched row: the hint is incomplete, look at the rows
        else:
            if digests is not None:
                digests = digests.with_rows(data, rb, touched)
            # Rows of these chunks the hint did not name were not looked at: the next save re-examines them.
            unseen = set(changed_k)
            xxh_track = tuple("" if k in unseen else x for k, x in enumerate(xs))
    if touched is None:
        if digests is None or track.skip > 0:
            if track.skip > 0:  # densely updated recently: store in full without looking at rows
                return Decision(RowTrack(full.layout, full.xxh, None, step, None, _EMPTY,
                                         track.skip - 1, track.backoff), xs)
            # Changed for the first time since this process saw it: start tracking rows from this version.
            return Decision(RowTrack(full.layout, full.xxh, RowDigests.of(data, rb), step, None, _EMPTY,
                                     0, track.backoff), xs)
        touched, digests = digests.detect(data, rb, in_changed)
    patch = np.union1d(track.patch, touched)
    if patch.size == 0:  # the content is the base's again: store it plainly (its chunks deduplicate)
        return Decision(RowTrack(full.layout, xxh_track, digests, step, None, _EMPTY), xs)
    budget = policy.rebase_fraction * leaf.nbytes
    cost = patch.size * (rb + 8)
    # Rebase when another delta would raise the average bytes per save since the base (the patch is cumulative,
    # so it only grows; for a growing patch this minimises bytes written), or when it passes the cap.
    if cost <= budget and cost * track.cycle_saves <= track.cycle_bytes and base_usable(track.base_chunks):
        return Decision(RowTrack(full.layout, xxh_track, digests, track.base_step, track.base_chunks, patch,
                                 cycle_bytes=track.cycle_bytes + cost, cycle_saves=track.cycle_saves + 1),
                        xs, _gather(data, patch, rb))
    if touched.size * (rb + 8) > budget:  # dense update: stop looking at rows for a while
        backoff = min(MAX_BACKOFF, max(1, 2 * track.backoff))
        return Decision(RowTrack(full.layout, full.xxh, None, step, None, _EMPTY, backoff, backoff), xs)
    return Decision(RowTrack(full.layout, xxh_track, digests, step, None, _EMPTY), xs)  # rebase


def _covers(spans: list[tuple[int, int]], rows: np.ndarray, row_bytes: int, nrows: int) -> bool:
    """Whether every span holds at least one of the sorted ``rows``."""
    for off, length in spans:
        r0, r1 = off // row_bytes, min(nrows, -(-(off + length) // row_bytes))
        if np.searchsorted(rows, r0) == np.searchsorted(rows, r1):
            return False
    return True


def _gather(data: memoryview, rows: np.ndarray, row_bytes: int) -> tuple[np.ndarray, memoryview]:
    table = np.frombuffer(data, dtype=np.uint8).reshape(-1, row_bytes)
    return rows, memoryview(np.ascontiguousarray(table[rows]).reshape(-1))


def apply_patch(out: memoryview, pos: int, index: np.ndarray, values: np.ndarray, row_bytes: int) -> None:
    """Write the patched rows that overlap bytes [pos, pos + len(out)) of an entry into ``out``.

    ``index``: sorted row numbers; ``values``: (len(index), row_bytes) uint8. Works for any span, row-aligned or not
    (loading patches a whole entry at once, export one chunk at a time).
    """
    end = pos + len(out)
    lo = int(np.searchsorted(index, pos // row_bytes, "left"))
    hi = int(np.searchsorted(index, -(-end // row_bytes), "left"))
    if lo == hi:
        return
    dest = np.frombuffer(out, dtype=np.uint8)
    sel, vals = index[lo:hi], values[lo:hi]
    first, last = -(-pos // row_bytes), end // row_bytes  # rows lying wholly inside the span
    inside = (sel >= first) & (sel < last)
    if inside.any():
        dest[first * row_bytes - pos : last * row_bytes - pos].reshape(-1, row_bytes)[sel[inside] - first] = \
            vals[inside]
    for k in np.flatnonzero(~inside):  # rows cut by the span's ends
        r0 = int(sel[k]) * row_bytes
        a, b = max(r0, pos), min(r0 + row_bytes, end)
        dest[a - pos : b - pos] = vals[k, a - r0 : b - r0]


def decode_patch(e: dict[str, Any], index_bytes: memoryview, value_bytes: memoryview, where: str
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """(row numbers, values (rows, row_bytes), row_bytes) of a verified delta, after checking the row numbers."""
    nrows = e["shape"][0]
    row_bytes = e["nbytes"] // nrows
    index = np.frombuffer(index_bytes, dtype="<i8")
    if index.size and (index[0] < 0 or index[-1] >= nrows or (index.size > 1 and np.any(index[1:] <= index[:-1]))):
        raise CorruptManifestError(
            f"{where}: entry {e['path']!r} row delta has row numbers that are not sorted, unique and below {nrows}")
    values = np.frombuffer(value_bytes, dtype=np.uint8).reshape(index.size, row_bytes)
    return index.astype(np.int64, copy=False), values, row_bytes

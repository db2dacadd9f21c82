"""Row deltas (docs/format.md §5.2): a large, sparsely updated table stored as base chunks + changed rows.

An entry with at least two dimensions is a table of ``shape[0]`` rows of ``nbytes // shape[0]`` bytes. When only a
few rows changed, the manifest lists the chunks of one earlier full version of the entry (its *base*) and the rows
that differ from it: their indices (sorted int64) and values. The patch is always against the base, never against
another patch (depth 1), so loading reads the base chunks and the patch, and nothing else. When the patch grows past
``rebase_fraction`` of the table, the entry is written in full again and becomes the new base. In repositories of
format 7 the patch is kept in segments (runs applied in order): a save keeps the segments the previous save stored,
by reference (read back and checked first when another process wrote them, §5.5), and appends the rows changed since
as one more, so it writes those rows only.

Detection: per-chunk XXH3 (computed anyway) finds the chunks that changed since the previous save; within those,
per-row XXH3-128 digests are compared with the digests of the previous save's rows, which this process keeps in
memory (16 bytes per row). Rows whose digest moved are added to the patch. Digests are only computed for a table
once it has changed after its first save in this process, so frozen tables cost nothing, and that first change is
written in full (it becomes the base). A training loop that knows which rows it touched can say so
(``touched_rows=``), which skips the row digests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import UnsupportedValueError, UsageError
from ..format.manifest import patch_segments
from ..tree import Leaf

_EMPTY = np.empty(0, dtype=np.int64)
MAX_BACKOFF = 32  # saves without detection after a table was found densely updated (doubling from 1)


@dataclass(frozen=True)
class DeltaPolicy:
    """When to store entries as deltas against a base version (docs/format.md §5.2, §5.4).

    Row deltas: tables (tensors with >= 2 dimensions) at least ``min_bytes`` large are candidates.
    ``rebase_fraction``: the entry is written in full (and becomes the new base) once its patch (values + 8-byte
    indices) would exceed this fraction of its size (a cap on load work: a restore reads base + patch, so 0.08
    keeps it within ~1.1x of a full checkpoint's), or earlier, once another delta would raise the average bytes
    written per save since the base (docs/format.md §5.2, benchmarks P3 and P4).
    XOR deltas (``xor=True``): an entry of at least ``xor_min_bytes`` that changed densely (a full fine-tune moves
    every weight a little) is stored as its XOR against the base version, compressed, while that costs at most
    ``xor_fraction`` of the entry's size (and less than storing it plainly) and the same average rule holds. They
    only pay with compression on.
    ``enabled=False`` stores every entry as plain chunks (no deltas of either kind).
    """

    enabled: bool = True
    min_bytes: int = 16 << 20
    rebase_fraction: float = 0.08
    xor: bool = True
    xor_min_bytes: int = 1 << 20
    # 0.5: an XOR delta must at least halve the entry to be worth its CPU. It reads the base back, XORs, splits and
    # codes planes: 2-2.5 ms more per MiB than storing fp32 raw (0.55 ms), 0.4-1.2 ms more than coding bf16 (4.4 ms),
    # one core here. A full fp32 fine-tune's deltas store 0.56-0.6 of the weights (GPT-2, AdamW lr 1e-5; the low two
    # mantissa bytes are noise): with 0.6 they were written at 1.9-2.6x the time of an uncompressed save for 1.44x
    # fewer bytes, flipping between delta and full as entries crossed 0.6 (benchmarks/fullft_fp32.py, 133 MiB).
    # bf16 fine-tunes' deltas store 0.15-0.45 of the weights (P13, tests/test_engine2_deltas.py) and are kept.
    xor_fraction: float = 0.5

    def __post_init__(self) -> None:
        for name in ("min_bytes", "xor_min_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"DeltaPolicy.{name} must be a positive int, got {v!r}")
        for name in ("rebase_fraction", "xor_fraction"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1):
                raise UsageError(f"DeltaPolicy.{name} must be between 0 and 1, got {v!r}")

    def eligible(self, leaf: Leaf) -> bool:
        """A candidate for row deltas."""
        return (self.enabled and leaf.alias_of is None and not leaf.scalar and len(leaf.shape) >= 2
                and leaf.shape[0] >= 2 and leaf.nbytes >= self.min_bytes)

    def xor_eligible(self, leaf: Leaf) -> bool:
        """A candidate for XOR deltas."""
        return (self.enabled and self.xor and leaf.alias_of is None and not leaf.scalar
                and leaf.nbytes >= self.xor_min_bytes)

    def tracked(self, leaf: Leaf) -> bool:
        return self.eligible(leaf) or self.xor_eligible(leaf)


Segment = tuple[int, tuple[tuple[str, int, str], ...], tuple[tuple[str, int, str], ...]]
WRITER_SEGMENTS = 16  # segments this writer keeps in one patch before it compacts them into one


@dataclass(frozen=True)
class RowTrack:
    """What this process knows about one delta-candidate entry after a committed save (per run, per entry path).

    A track read from a manifest on disk (the first save of a run in a process) has ``xxh=()`` and ``trusted=False``:
    nothing of it is believed except the base chunks' BLAKE3 addresses, which are checked against the bytes."""

    layout: tuple[Any, ...]  # (kind, dtype, shape): a track only applies to the same layout
    xxh: tuple[str, ...]  # XXH3-128 of each chunk of the content that save stored
    digests: RowDigests | None  # row (and row-block) digests of that content; None: not tracked
    base_step: int  # the step whose full version is the base
    base_chunks: list[tuple[str, int, str]] | None  # that version's chunks (hash, size, xxh3), set once it commits
    patch: np.ndarray  # sorted row numbers differing from the base (empty: not a row delta)
    skip: int = 0  # saves left without row detection (backoff after dense updates)
    backoff: int = 0
    cycle_bytes: int = 0  # bytes written for this entry since (and including) its base
    cycle_saves: int = 0  # saves since (and including) the base
    form: str = "full"  # how that save stored it: "full", "rows" (row delta) or "xor" (XOR delta)
    xor_bytes: int = 0  # bytes the last XOR delta of this entry stored (its cost estimate for the next one)
    xor_skip: int = 0  # saves left without trying XOR deltas (backoff after one that did not pay)
    xor_backoff: int = 0
    trusted: bool = True  # False: read from disk, so xxh and patch are unknown (compare against the base bytes)
    base_checked: bool = True  # the base chunks' XXH3s are this process's own (False: from disk, never used)
    # How that save stored the patch (form "rows", repositories of format 7): its segments, oldest first, each
    # (rows, index chunks, values chunks). From disk (``trusted=False``) they are only candidates: a save reads
    # them back and checks them before it keeps them (deltaplan._after_disk_segments).
    segments: tuple[Segment, ...] = ()

    def segment_bytes(self, row_bytes: int) -> int:
        """Bytes a restore reads for the stored segments (values + 8 bytes of index per row)."""
        return sum(n for n, _i, _v in self.segments) * (row_bytes + 8)


@dataclass
class Decision:
    """The save pipeline's plan for one delta-candidate entry."""

    track: RowTrack  # the entry's track once this save commits (base_chunks filled in by the caller if full)
    xxh: list[str]  # chunk XXH3s of the current content (reused by the pipeline)
    delta: tuple[np.ndarray, memoryview] | None = None  # (row numbers, their values) when stored as a row delta
    xor: bool = False  # stored as XOR against the base chunks
    hashes: list[str] | None = None  # BLAKE3 of the current chunks, when the plan computed them
    same: list[bool] | None = None  # XOR deltas: chunks shown equal to the base's (their XOR is all zeros)
    kept: tuple[Segment, ...] = ()  # row deltas: segments of the previous save's patch stored again by reference;
    # ``delta`` is then the new segment after them (None: no row changed since that save)


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


def gather(data: memoryview, rows: np.ndarray, row_bytes: int) -> tuple[np.ndarray, memoryview]:
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
    rows_here = dest[first * row_bytes - pos : last * row_bytes - pos].reshape(-1, row_bytes)
    if inside.all():  # the usual case (row-aligned chunks): scatter the values' slice as it is, with no masked copy
        rows_here[sel - first] = vals
        return
    if inside.any():
        rows_here[sel[inside] - first] = vals[inside]
    for k in np.flatnonzero(~inside):  # rows cut by the span's ends
        r0 = int(sel[k]) * row_bytes
        a, b = max(r0, pos), min(r0 + row_bytes, end)
        dest[a - pos : b - pos] = vals[k, a - r0 : b - r0]


def decode_patch(e: dict[str, Any], index_bytes: memoryview, value_bytes: memoryview, where: str
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """([(row numbers, values (rows, row_bytes)) per segment], row_bytes) of a verified delta, after checking the
    row numbers (format.manifest.patch_segments, which ``verify`` runs too). Segments apply in order."""
    row_bytes = e["nbytes"] // e["shape"][0]
    segments = patch_segments(e, index_bytes, where)
    nindex = sum(len(seg) for _start, seg in segments)
    values = np.frombuffer(value_bytes, dtype=np.uint8).reshape(nindex, row_bytes)
    return [(seg.astype(np.int64, copy=False), values[start : start + len(seg)]) for start, seg in segments], row_bytes

"""Row maps (docs/format.md §17.7): a row-structured array (flat codes, an id map, the rows of an IVF's lists) kept
as a **pool** of stored rows, which only grows, plus **runs** ``(pool start, count)`` naming the pool rows that make
the live array, in order. A ``remove_ids`` compacts faiss's arrays (flat: every later row shifts; IVF: a list's last
entry moves into the removed slot), so the byte layout changes everywhere after the first removal; as a row map,
the pool keeps every stored row and only the runs change (a few per removed row), plus the rows that are new.

This module is the arithmetic: runs <-> per-row pool indices, matching live rows to pool rows by content (exact),
checking runs read from a manifest. No faiss, no repository.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from .extents import Gathered

BLOCK = 1 << 16  # rows compared at once (bounds the temporary memory of the exact comparison)
HASHED = 64  # bytes of each column's rows that the proposing hash reads
_MUL = np.uint64(0x9E3779B97F4A7C15)


def expand(runs: np.ndarray) -> np.ndarray:
    """The pool index of every live row (int64), from runs ``[R, 2]``."""
    if len(runs) == 0:
        return np.empty(0, dtype=np.int64)
    starts, counts = runs[:, 0].astype(np.int64), runs[:, 1].astype(np.int64)
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def compress(idx: np.ndarray) -> np.ndarray:
    """Runs ``[R, 2]`` (int64: pool start, count) of per-row pool indices: one run per maximal consecutive stretch."""
    n = len(idx)
    if n == 0:
        return np.empty((0, 2), dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(idx) != 1) + 1))
    counts = np.diff(np.append(starts, n))
    return np.stack([idx[starts], counts], axis=1).astype(np.int64)


def check_runs(runs: np.ndarray, pool_rows: int, rows: int, bad: Callable[[str], Exception], where: str) -> None:
    """Runs read from a manifest name only pool rows and add up to ``rows`` (before anything is sized by them)."""
    if runs.ndim != 2 or runs.shape[1] != 2:
        raise bad(f"the runs {where} are not [runs, 2]")
    if len(runs) and (bool((runs[:, 1] < 1).any()) or bool((runs[:, 0] < 0).any())
                      or bool((runs[:, 0] > pool_rows - runs[:, 1]).any())):
        raise bad(f"the runs {where} name rows outside its pool of {pool_rows}")
    if int(runs[:, 1].sum()) != rows:
        raise bad(f"the runs {where} add up to {int(runs[:, 1].sum())} rows, it says {rows}")


def digest(columns: list[Gathered]) -> str:
    """XXH3-128 of the live bytes of every column, in order (the row map's ``xxh3``)."""
    h = xxhash.xxh3_128()
    for col in columns:
        for piece in col.pieces:
            h.update(piece)
    return h.hexdigest()


def column_rows(col: Gathered | np.ndarray, rows: int) -> np.ndarray:
    """A column as a uint8 matrix ``[rows, width]`` (zero-copy for one piece or an array, else one copy)."""
    if isinstance(col, np.ndarray):
        flat = col.reshape(-1).view(np.uint8)
    else:
        flat = np.frombuffer(col.view(0, len(col)), dtype=np.uint8) if len(col) else np.empty(0, np.uint8)
    return flat.reshape(rows, -1) if rows else np.empty((0, 0), np.uint8)


_KEYS = np.random.default_rng(0x1F3D5B79).integers(1, 1 << 63, size=4096, dtype=np.uint64) | np.uint64(1)


def _hashes(cols: list[np.ndarray]) -> np.ndarray:
    """A 64-bit hash of each row across the columns: each 8-byte word times its own odd key, summed (mod 2^64), then
    mixed. Only a proposal: matches are compared byte for byte."""
    n = len(cols[0])
    h = np.zeros(n, dtype=np.uint64)
    k = 0
    with np.errstate(over="ignore"):
        for mat in cols:
            w = min(mat.shape[1], HASHED)  # a prefix proposes well enough; the comparison decides
            whole = w // 8 * 8
            if whole:
                words = np.ascontiguousarray(mat[:, :whole]).view("<u8")
                h += (words * _KEYS[k % 4000:k % 4000 + words.shape[1]]).sum(axis=1, dtype=np.uint64)
                k += words.shape[1]
            for j in range(whole, w):
                h += mat[:, j].astype(np.uint64) * _KEYS[4000 + (j - whole)]
            h ^= h >> np.uint64(31)
            h *= _MUL
    return h


def match(pool: list[np.ndarray], live: list[np.ndarray]) -> np.ndarray:
    """For each live row, the index of a pool row with exactly its bytes in every column, or -1 (compared byte for
    byte: a hash only proposes the candidate). ``pool`` and ``live``: per column, uint8 matrices ``[rows, width]``."""
    n, m = len(live[0]), len(pool[0])
    if n == 0 or m == 0:
        return np.full(n, -1, dtype=np.int64)
    hp, hl = _hashes(pool), _hashes(live)
    order = np.argsort(hp, kind="stable")
    sorted_h = hp[order]
    pos = np.minimum(np.searchsorted(sorted_h, hl), m - 1)
    cand = np.where(sorted_h[pos] == hl, order[pos], -1).astype(np.int64)

    pool_v, live_v = [_rows_void(c) for c in pool], [_rows_void(c) for c in live]

    def equal(p_idx: np.ndarray, l_idx: np.ndarray) -> np.ndarray:
        ok = np.ones(len(l_idx), dtype=bool)
        for pc, lc in zip(pool_v, live_v):
            ok &= np.take(pc, p_idx) == np.take(lc, l_idx)
        return ok

    # a run continues where the next pool row is equal too (duplicate rows would otherwise cut runs)
    nxt = np.append(-1, cand[:-1] + 1)
    sel = np.flatnonzero((nxt >= 0) & (nxt < m) & (nxt != cand) & (cand >= 0))
    for a in range(0, len(sel), BLOCK):
        part = sel[a:a + BLOCK]
        same = part[equal(nxt[part], part)]
        cand[same] = nxt[same]
    for a in range(0, n, BLOCK):  # the exact check
        has = np.flatnonzero(cand[a:a + BLOCK] >= 0) + a
        cand[has[~equal(cand[has], has)]] = -1
    return cand


def _rows_void(mat: np.ndarray) -> np.ndarray:
    """Each row as one opaque value (compared as bytes)."""
    mat = np.ascontiguousarray(mat)
    return mat.view(f"V{mat.shape[1]}").reshape(-1) if mat.shape[1] else np.zeros(len(mat), "V1")

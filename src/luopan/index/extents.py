"""Extent chunking (docs/format.md §17.3): an array keeps every chunk of its previous version whose bytes are still at
the same offset (checked by XXH3-128 against the previous row, never trusted), and only the rest is cut fresh, so an
append-only array (flat codes, ids, each inverted list) costs its new tail. New chunks go through the core
(``store_chunks``: BLAKE3 addressed, deduplicated, packed, indexed); reading checks every chunk's BLAKE3."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..format.manifest import Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk, read_chunks
from ..repository.chunkstore import store_chunks
from ..repository.chunkwriter import ChunkWriter
from ..repository.parallel import WORKERS
from ..store.base import Store

TAIL_SLACK = 4  # rows allowed beyond twice the fresh count before an array is re-cut fresh


@dataclass
class Piece:
    offset: int
    size: int
    row: Row | None = None  # the previous version's row, reused; None: new bytes
    source: int = -1  # its index among the new pieces


@dataclass
class Written:
    entries: list[dict[str, Any]]
    packs: list[str]
    new_bytes: int = 0
    stored_bytes: int = 0
    new_chunks: int = 0
    new_packs: int = 0
    chunks: int = 0


def as_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B") if arr.size else memoryview(b"")


class Gathered:
    """A byte array made of pieces (views of faiss memory, never copied whole): an IVF segment is the run of every
    list's slice. ``xxh3`` hashes a range across pieces; ``view`` is zero-copy within one piece, else a copy."""

    def __init__(self, pieces: list[memoryview]) -> None:
        self.pieces = [p for p in pieces if len(p)]
        self.starts: list[int] = []
        total = 0
        for p in self.pieces:
            self.starts.append(total)
            total += len(p)
        self.size = total

    def __len__(self) -> int:
        return self.size

    def spans(self, off: int, size: int) -> Iterator[tuple[memoryview, int]]:
        """(piece slice, offset within the range) covering [off, off + size)."""
        i = max(0, bisect.bisect_right(self.starts, off) - 1)
        end = off + size
        while off < end:
            p, start = self.pieces[i], self.starts[i]
            a, b = off - start, min(len(p), end - start)
            yield p[a:b], off - (end - size)
            off += b - a
            i += 1

    def xxh3(self, off: int, size: int) -> str:
        if len(self.pieces) == 1:
            return xxhash.xxh3_128_hexdigest(self.pieces[0][off:off + size])
        h = xxhash.xxh3_128()
        for part, _at in self.spans(off, size):
            h.update(part)
        return h.hexdigest()

    def view(self, off: int, size: int) -> memoryview:
        parts = list(self.spans(off, size))
        if len(parts) == 1:
            return parts[0][0]
        out = bytearray(size)
        for part, at in parts:
            out[at:at + len(part)] = part
        return memoryview(out)


def _fresh(start: int, end: int, chunk: int) -> list[Piece]:
    return [Piece(o, min(chunk, end - o)) for o in range(start, end, chunk)]


def plan_extents(buf: Gathered, previous: list[list[Any]], chunk: int,
                 reusable: Callable[[Row], bool]) -> list[Piece]:
    """The pieces of ``buf``: previous rows still valid at their offset (XXH3-128 equal, chunk reusable) are kept; gaps
    are cut into pieces of at most ``chunk`` bytes from their start; small trailing pieces are merged while the last
    is at least half the one before and both fit one chunk (amortized: a byte is rewritten O(log) times); an array
    with more than ``2 * fresh + TAIL_SLACK`` pieces is cut fresh."""
    size = len(buf)
    kept: list[Piece] = []
    off = 0
    for raw in previous:
        r = Row._make(raw)
        if off + r.size <= size and buf.xxh3(off, r.size) == r.xxh3 and reusable(r):
            kept.append(Piece(off, r.size, r))
        off += r.size
    pieces: list[Piece] = []
    pos = 0
    for p in kept:
        pieces.extend(_fresh(pos, p.offset, chunk))
        pieces.append(p)
        pos = p.offset + p.size
    pieces.extend(_fresh(pos, size, chunk))
    while len(pieces) >= 2:
        a, b = pieces[-2], pieces[-1]
        if a.size + b.size > chunk or 2 * b.size < a.size:
            break
        pieces[-2:] = [Piece(a.offset, a.size + b.size)]
    fresh = max(1, -(-size // chunk))
    if len(pieces) > 2 * fresh + TAIL_SLACK:
        pieces = _fresh(0, size, chunk)
    return pieces


class Appended:
    """An array made of an earlier entry's chunk rows, kept as they are (their bytes need not be in memory: a row
    map's pool, docs/format.md §17.7), followed by new bytes."""

    def __init__(self, rows: list[list[Any]], tail: Gathered) -> None:
        self.rows = [Row._make(r) for r in rows]
        self.base = sum(r.size for r in self.rows)
        self.tail = tail

    def view(self, off: int, size: int) -> memoryview:
        return self.tail.view(off - self.base, size)

    def plan(self, chunk: int) -> list[Piece]:
        pieces, off = [], 0
        for r in self.rows:
            pieces.append(Piece(off, r.size, r))
            off += r.size
        fresh = _fresh(0, len(self.tail), chunk)
        while len(fresh) >= 2 and fresh[-2].size + fresh[-1].size <= chunk:
            a, b = fresh[-2], fresh[-1]
            fresh[-2:] = [Piece(a.offset, a.size + b.size)]
        return pieces + [Piece(p.offset + self.base, p.size) for p in fresh]


def write_arrays(chunks: ChunkWriter, arrays: list[tuple[str, np.ndarray | Gathered | Appended, str, list[int]]],
                 previous: dict[str, dict[str, Any]], chunk: int) -> Written:
    """Store ``arrays`` (path, array) as manifest entries through ``chunks``, reusing the ``previous`` version's
    entries by path (an Appended array keeps its rows, which the caller checked are reusable)."""
    def reusable(r: Row) -> bool:
        return chunks.reusable(r.hash)

    plans: list[tuple[str, str, list[int], list[Piece]]] = []
    new: list[tuple[Gathered | Appended, Piece]] = []
    for path, arr, dtype, shape in arrays:
        buf: Gathered | Appended
        if isinstance(arr, Appended):
            buf, pieces = arr, arr.plan(chunk)
        else:
            buf = arr if isinstance(arr, Gathered) else Gathered([as_bytes(arr)])
            prev = previous.get(path)
            pieces = plan_extents(buf, prev["chunks"] if prev is not None else [], chunk, reusable)
        for p in pieces:
            if p.row is None:
                p.source = len(new)
                new.append((buf, p))
        plans.append((path, dtype, shape, pieces))

    def produce() -> Iterator[tuple[int, memoryview]]:
        for buf, p in new:
            yield p.source, buf.view(p.offset, p.size)

    stored = store_chunks(chunks, produce, len(new))
    pack_ids: dict[str, int] = {}
    out = Written([], [])
    for path, dtype, shape, pieces in plans:
        rows = []
        for p in pieces:
            if p.row is not None:
                h, size, x = p.row.hash, p.row.size, p.row.xxh3
            else:
                (h, size, x), = stored.rows[p.source]
            loc = chunks.location(h)
            rows.append([h, pack_ids.setdefault(loc.pack, len(pack_ids)), loc.offset, loc.length, size, loc.codec, x])
        out.entries.append({"path": path, "dtype": dtype, "shape": shape, "chunking": "extent",
                            "chunks": rows})
        out.chunks += len(rows)
    out.packs = list(pack_ids)
    out.new_bytes, out.stored_bytes = stored.new_bytes, stored.stored_bytes
    out.new_chunks, out.new_packs = stored.new_chunks, stored.new_packs
    return out


_tls = threading.local()


def _scratch(size: int) -> memoryview:
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        buf = _tls.buf = bytearray(size)
    return memoryview(buf)[:size]


def read_into(store: Store, owner: str, doc: dict[str, Any],
              targets: list[tuple[dict[str, Any], np.ndarray | Gathered]]) -> None:
    """Read and verify each entry's chunks into its target (exactly the entry's bytes): straight into an array, or
    through per-thread scratch memory for a chunk that spans several pieces of a Gathered target."""
    packs = doc["packs"]
    jobs: list[tuple[ChunkRef, Gathered, int]] = []
    for entry, target in targets:
        dest = target if isinstance(target, Gathered) else Gathered([as_bytes(target)])
        off = 0
        for n, r in enumerate(map(Row._make, entry["chunks"])):
            ref = ChunkRef(owner, entry["path"], n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)
            jobs.append((ref, dest, off))
            off += r.size
    sizes = PackSizes(store)
    sizes.prefetch({ref.pack for ref, _d, _o in jobs})
    direct = [(ref, dest.pieces[0][off:off + ref.size]) for ref, dest, off in jobs if len(dest.pieces) == 1]
    spread = [job for job in jobs if len(job[1].pieces) != 1]
    read_chunks(store, direct, sizes=sizes)

    def one(job: tuple[ChunkRef, Gathered, int]) -> None:
        ref, dest, off = job
        parts = list(dest.spans(off, ref.size))
        if len(parts) == 1:
            read_chunk(store, ref, parts[0][0], sizes)
            return
        sizes.check(ref)  # before the scratch buffer is sized by the row
        tmp = _scratch(ref.size)
        read_chunk(store, ref, tmp, sizes)
        for part, at in parts:
            part[:] = tmp[at:at + len(part)]

    if len(spread) <= 1:
        for job in spread:
            one(job)
        return
    with ThreadPoolExecutor(WORKERS, "luopan-index-read") as pool:
        list(pool.map(one, spread))

"""Reading a checkpoint's entries back: chunk references of manifest entries, row deltas applied as their base chunks
are read (chunks are read and verified by luopan.repository.chunkio)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.manifest import Manifest, Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunks
from ..store.base import Store
from .rowdelta import apply_patch, decode_patch


def chunk_refs(m: Manifest, entry_index: int, part: str | None = None) -> Iterator[tuple[int, ChunkRef]]:
    """(byte offset, ChunkRef) for each chunk of an entry: its (base) chunks, or with ``part`` "index"/"values"
    those of its row delta (offsets within that part)."""
    e = m.entries[entry_index]
    chunks = e.get("chunks", []) if part is None else e["delta"][part]
    path = e["path"] if part is None else f"{e['path']} (row delta {part})"
    pos = 0
    for n, r in enumerate(map(Row._make, chunks)):
        yield pos, ChunkRef(f"run {m.run!r} step {m.step}", path, n, r.hash, m.packs[r.pack], r.offset, r.length, r.size, r.codec)
        pos += r.size


def all_chunk_refs(m: Manifest, entry_index: int) -> Iterator[ChunkRef]:
    """Every chunk an entry needs: its (base) chunks and, for a row delta, the delta's index and values."""
    yield from (ref for _pos, ref in chunk_refs(m, entry_index))
    if "delta" in m.entries[entry_index]:
        for part in ("index", "values"):
            yield from (ref for _pos, ref in chunk_refs(m, entry_index, part))


@dataclass
class PendingDelta:
    """The row delta of one entry, read alongside its base chunks and applied once all are verified."""

    manifest: Manifest
    entry_index: int
    index: memoryview
    values: memoryview
    _decoded: tuple[np.ndarray, np.ndarray, int] | None = None

    def decode(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(row numbers, values, row bytes), checked once (call only after the chunks were read and verified)."""
        if self._decoded is None:
            e = self.manifest.entries[self.entry_index]
            self._decoded = decode_patch(e, self.index, self.values,
                                         f"run {self.manifest.run!r} step {self.manifest.step}")
        return self._decoded

    def apply(self, out: memoryview, pos: int = 0) -> None:
        """Patch bytes [pos, pos + len(out)) of the entry in ``out`` (the whole entry by default)."""
        apply_patch(out, pos, *self.decode())


def entry_jobs(store: Store, m: Manifest, entry_index: int, dest: memoryview,
               sizes: PackSizes | None = None) -> list[Any]:
    """Read jobs that fill ``dest`` with an entry's bytes. A row delta's index and values are read (and verified)
    first; each base chunk is then patched by the worker that read it, so applying a delta costs little more than
    reading the patch."""
    delta, jobs = delta_jobs(m, entry_index)
    if delta is None:
        return [(ref, dest[pos : pos + ref.size]) for pos, ref in chunk_refs(m, entry_index)]
    read_chunks(store, jobs, sizes=sizes)
    delta.decode()  # check the row numbers once, before any worker uses them

    def patcher(pos: int) -> Callable[[memoryview], None]:
        return lambda out: delta.apply(out, pos)

    return [(ref, dest[pos : pos + ref.size], patcher(pos)) for pos, ref in chunk_refs(m, entry_index)]


def delta_jobs(m: Manifest, entry_index: int) -> tuple[PendingDelta | None, list[tuple[ChunkRef, memoryview]]]:
    """Buffers and read jobs for an entry's row delta (None, [] when it has none)."""
    d = m.entries[entry_index].get("delta")
    if d is None:
        return None, []
    pending = PendingDelta(m, entry_index, memoryview(bytearray(sum(Row._make(c).size for c in d["index"]))),
                           memoryview(bytearray(sum(Row._make(c).size for c in d["values"]))))
    jobs = [(ref, buf[pos : pos + ref.size]) for part, buf in (("index", pending.index), ("values", pending.values))
            for pos, ref in chunk_refs(m, entry_index, part)]
    return pending, jobs


def check_rows(store: Store, m: Manifest, entries: list[int] | None = None,
               sizes: PackSizes | None = None) -> PackSizes:
    """Check every chunk row of ``m`` (or of the given entries) against its pack's real size, before anything is
    allocated for them; returns the size cache for the reads that follow."""
    sizes = sizes or PackSizes(store)
    refs = [ref for i in (range(len(m.entries)) if entries is None else entries) for ref in all_chunk_refs(m, i)]
    sizes.prefetch({ref.pack for ref in refs})
    for ref in refs:
        sizes.check(ref)
    return sizes



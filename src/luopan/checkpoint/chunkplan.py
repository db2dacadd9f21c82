"""Which chunks a checkpoint entry's bytes come from (its read plan): the chunk references of manifest entries, and
row deltas applied as their base chunks are read (chunks are read and verified by luopan.repository.chunkio)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._memory import advise_huge_pages
from ..format.manifest import Manifest, Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk
from ..store.base import Store
from .rowdelta import apply_patch, decode_patch


def chunk_refs(m: Manifest, entry_index: int, part: str | None = None) -> Iterator[tuple[int, ChunkRef]]:
    """(byte offset, ChunkRef) for each chunk of an entry: its (base) chunks, or with ``part`` "index"/"values"
    those of its row delta (offsets within that part)."""
    e = m.entries[entry_index]
    if part is None:
        chunks, path = e.get("chunks", []), e["path"]
    elif part == "xor":
        chunks, path = e["xor"]["chunks"], f"{e['path']} (XOR delta)"
    else:
        chunks, path = e["delta"][part], f"{e['path']} (row delta {part})"
    pos = 0
    for n, r in enumerate(map(Row._make, chunks)):
        yield pos, ChunkRef(f"run {m.run!r} step {m.step}", path, n, r.hash, m.packs[r.pack], r.offset, r.length,
                            r.size, r.codec, r.xxh3 if m.xxh3_reads else "")
        pos += r.size


def all_chunk_refs(m: Manifest, entry_index: int) -> Iterator[ChunkRef]:
    """Every chunk an entry needs: its (base) chunks and, for a row delta, the delta's index and values, for an XOR
    delta its chunks."""
    yield from (ref for _pos, ref in chunk_refs(m, entry_index))
    if "delta" in m.entries[entry_index]:
        for part in ("index", "values"):
            yield from (ref for _pos, ref in chunk_refs(m, entry_index, part))
    if "xor" in m.entries[entry_index]:
        yield from (ref for _pos, ref in chunk_refs(m, entry_index, "xor"))


@dataclass
class PendingDelta:
    """The row delta of one entry, read alongside its base chunks and applied once all are verified."""

    manifest: Manifest
    entry_index: int
    index: memoryview
    values: memoryview
    _decoded: tuple[list[tuple[np.ndarray, np.ndarray]], int] | None = None

    def decode(self) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        """([(row numbers, values) per segment], row bytes), checked once (call only after the chunks were read and
        verified)."""
        if self._decoded is None:
            e = self.manifest.entries[self.entry_index]
            self._decoded = decode_patch(e, self.index, self.values,
                                         f"run {self.manifest.run!r} step {self.manifest.step}")
        return self._decoded

    def apply(self, out: memoryview, pos: int = 0) -> None:
        """Patch bytes [pos, pos + len(out)) of the entry in ``out`` (the whole entry by default)."""
        segments, row_bytes = self.decode()
        for index, values in segments:  # in order: a row in a later segment overrides an earlier one (§5.2)
            apply_patch(out, pos, index, values, row_bytes)


class PendingXor:
    """The XOR delta of one entry (docs/format.md §5.4): chunk k of it is XORed into base chunk k. Its chunks are
    read (and verified) as the base chunks they apply to are, by the same worker."""

    def __init__(self, store: Store, m: Manifest, entry_index: int, sizes: PackSizes | None) -> None:
        self.store, self.sizes = store, sizes or PackSizes(store)
        self.refs = list(chunk_refs(m, entry_index, "xor"))
        self.starts = [pos for pos, _ref in self.refs]  # sorted: the chunks lie end to end

    def decode(self) -> None:
        """Nothing to check ahead (the chunk sizes were checked with the manifest)."""

    def apply(self, out: memoryview, pos: int = 0) -> None:
        """XOR the delta into bytes [pos, pos + len(out)) of the entry held in ``out``."""
        end = pos + len(out)
        dest = np.frombuffer(out, dtype=np.uint8)
        first = max(0, bisect.bisect_right(self.starts, pos) - 1)
        for xpos, ref in self.refs[first:]:
            if xpos >= end:
                break
            if xpos + ref.size <= pos:
                continue
            self.sizes.check(ref)
            buf = _xor_scratch(ref.size)
            read_chunk(self.store, ref, buf, self.sizes)
            a, b = max(pos, xpos), min(end, xpos + ref.size)
            np.bitwise_xor(dest[a - pos : b - pos], np.frombuffer(buf, dtype=np.uint8)[a - xpos : b - xpos],
                           out=dest[a - pos : b - pos])


_tls = threading.local()


def _xor_scratch(size: int) -> memoryview:
    buf = getattr(_tls, "xor", None)
    if buf is None or len(buf) < size:
        buf = _tls.xor = bytearray(size)
    return memoryview(buf)[:size]


def entry_jobs(store: Store, m: Manifest, entry_index: int, dest: memoryview,
               sizes: PackSizes | None = None) -> list[Any]:
    """Read jobs (for ``read_chunks``) that fill ``dest`` with an entry's bytes. A row delta's index and values
    chunks come first, as jobs of their own, so they are read (and verified) on the workers alongside the base
    chunks rather than before them; each base chunk is then patched by the worker that read it, once the whole
    patch is in (``_PatchReads``), so applying a delta costs little more than reading the patch. An XOR delta's
    chunk is read and applied by the worker that read its base chunk."""
    delta, jobs = delta_jobs(m, entry_index, store, sizes)
    if delta is None:
        return [(ref, dest[pos : pos + ref.size]) for pos, ref in chunk_refs(m, entry_index)]
    if isinstance(delta, PendingXor):
        return [(ref, dest[pos : pos + ref.size], _patcher(delta, pos)) for pos, ref in chunk_refs(m, entry_index)]
    reads = _PatchReads(store, delta, jobs, sizes or PackSizes(store))
    return [*reads.jobs(), *((ref, dest[pos : pos + ref.size], reads.patcher(pos))
                             for pos, ref in chunk_refs(m, entry_index))]


def _patcher(delta: PendingXor, pos: int) -> Callable[[memoryview], None]:
    return lambda out: delta.apply(out, pos)


class _PatchReads:
    """The chunks of one row delta's patch, read by jobs of their own queued ahead of the base chunks. A base chunk's
    worker that needs the patch before every patch chunk is in reads the ones no worker has started (their jobs may
    never run: a failed batch cancels the jobs still queued) and waits only for those another worker is reading, so
    nothing ever waits on work that is not running. The row numbers are checked once, by whichever worker completes
    the patch; a failure is raised, as the same typed error, by every job that needs the patch."""

    _TODO, _READING, _DONE, _FAILED = range(4)

    def __init__(self, store: Store, delta: PendingDelta, jobs: list[tuple[ChunkRef, memoryview]],
                 sizes: PackSizes) -> None:
        self.store, self.delta, self.reads, self.sizes = store, delta, jobs, sizes
        self.lock = threading.Lock()
        self.state = [self._TODO] * len(jobs)
        self.done = [threading.Event() for _ in jobs]
        self.errors: list[BaseException | None] = [None] * len(jobs)
        self.decoded: BaseException | bool = False

    def jobs(self) -> list[Callable[[], None]]:
        return [lambda k=k: self._read(k) for k in range(len(self.reads))]

    def _read(self, k: int) -> None:
        """Read patch chunk ``k`` unless a worker already has (or is): then wait for it; raise if it failed."""
        with self.lock:
            mine = self.state[k] == self._TODO
            if mine:
                self.state[k] = self._READING
        if mine:
            try:
                read_chunk(self.store, *self.reads[k], self.sizes)  # into the patch's own buffer, never the target
            except BaseException as exc:
                self.errors[k], self.state[k] = exc, self._FAILED
                raise
            else:
                self.state[k] = self._DONE
            finally:
                self.done[k].set()
            return
        self.done[k].wait()  # another worker is reading it, or has
        if self.state[k] == self._FAILED:
            raise self.errors[k]  # type: ignore[misc]  # the same typed error, whichever job reports it

    def _ready(self) -> PendingDelta:
        for k in range(len(self.reads)):  # first read what no worker has started (unlocked peek: _read re-checks)
            if self.state[k] == self._TODO:
                self._read(k)
        for k in range(len(self.reads)):  # then wait for the rest
            self._read(k)
        with self.lock:
            if self.decoded is False:
                try:
                    self.delta.decode()  # check the row numbers once, before any worker uses them
                    self.decoded = True
                except BaseException as exc:
                    self.decoded = exc
                    raise
        if self.decoded is not True:
            raise self.decoded
        return self.delta

    def patcher(self, pos: int) -> Callable[[memoryview], None]:
        return lambda out: self._ready().apply(out, pos)


def delta_jobs(m: Manifest, entry_index: int, store: Store | None = None, sizes: PackSizes | None = None
               ) -> tuple[PendingDelta | PendingXor | None, list[tuple[ChunkRef, memoryview]]]:
    """Buffers and read jobs for an entry's row delta (None, [] when it has none). An XOR delta needs no reads
    ahead: its ``apply`` reads the chunks it needs from ``store``."""
    if "xor" in m.entries[entry_index]:
        if store is None:
            raise ValueError("an XOR delta is read from a store: pass store=")
        return PendingXor(store, m, entry_index, sizes), []
    d = m.entries[entry_index].get("delta")
    if d is None:
        return None, []
    pending = PendingDelta(m, entry_index, _patch_buffer(sum(Row._make(c).size for c in d["index"])),
                           _patch_buffer(sum(Row._make(c).size for c in d["values"])))
    jobs = [(ref, buf[pos : pos + ref.size]) for part, buf in (("index", pending.index), ("values", pending.values))
            for pos, ref in chunk_refs(m, entry_index, part)]
    return pending, jobs


def _patch_buffer(n: int) -> memoryview:
    """Memory the reads of a patch fill end to end: not zeroed first (a bytearray would be, page by page), with huge
    pages asked for when large."""
    buf = np.empty(n, dtype=np.uint8)
    advise_huge_pages(buf.ctypes.data, n)
    return memoryview(buf)


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



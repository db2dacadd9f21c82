"""Storing chunks for every kind: hashed on every core (BLAKE3 address, XXH3-128 for change detection), deduplicated
against the repository's chunk index, packed on background threads, then named by one index file (docs/format.md §6,
§7, §10). Kinds cut their own chunks (fixed, content-defined, extents) and hand them here."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import xxhash

from .._crash import crashpoint
from ..format import ENGINE2_FORMAT_VERSION
from ..format.config import RepoConfig
from ..format.index import build_index
from ..format.names import index_key
from ..format.pack import BlobLocation, PackBuilder
from ..store.base import Store
from .blobcodec import encode_blob
from .packwriter import PackChecker, PackWriter, exists_quietly
from .parallel import WORKERS, ordered_map

AHEAD = 64  # chunks cut ahead of hashing
ARENA = 16 << 20  # bytes of new chunks copied into one pooled buffer
INLINE_BYTES = 64 << 10  # smaller chunks are hashed on the calling thread (a handoff costs more)
GROUP_BYTES = 8 << 20


@dataclass
class Stored:
    """The chunks of each file, and what the commit added to the repository."""

    rows: list[list[tuple[str, int, str]]]  # per source: (hash, size, xxh3) of each chunk, in order
    locations: dict[str, BlobLocation]  # every chunk the rows name
    new_locations: dict[str, BlobLocation] = field(default_factory=dict)
    index_key: str | None = None
    new_chunks: int = 0
    new_bytes: int = 0
    stored_bytes: int = 0
    new_packs: int = 0


class BufferPool:
    """Read buffers, reused once nothing refers to them any more (no chunk view of one is still queued for hashing or
    held by a pack being written). Buffers are not zero-filled (``numpy.empty``): zeroing fresh memory, then reading
    over it, cost more than the reading."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []

    def get(self, size: int) -> memoryview:
        free = []
        for buf in self._buffers:
            # References: the list, this loop's name, getrefcount's argument; a live view of it adds one.
            if sys.getrefcount(buf) == 3:
                if len(buf) >= size:
                    return memoryview(buf)
                free.append(buf)
        if free:  # too small for this block and unused: let them go (the pool stays a handful of buffers)
            drop = {id(b) for b in free}
            self._buffers = [b for b in self._buffers if id(b) not in drop]
        buf = np.empty(size, dtype=np.uint8)
        self._buffers.append(buf)
        return memoryview(buf)


class Arenas:
    """Where new chunks are copied for their packs: pooled buffers of ARENA bytes, each reused once the packs holding
    views of it are durable. The read buffer of a chunk is then free for the next block at once, and no chunk gets a
    fresh allocation of its own (a 256 KiB ``bytes`` each cost page faults and unmaps: 3 s of system time for 1 GiB
    here)."""

    def __init__(self) -> None:
        self._pool = BufferPool()
        self._current: memoryview | None = None
        self._used = 0

    def copy(self, view: memoryview) -> memoryview:
        n = len(view)
        if self._current is None or self._used + n > len(self._current):
            self._current = None  # drop our reference: the pool sees the old arena as free once its packs are
            self._current = self._pool.get(max(ARENA, n))
            self._used = 0
        dst = self._current[self._used : self._used + n]
        dst[:] = view
        self._used += n
        return dst


class ahead:  # noqa: N801  (used like a generator)
    """Iterate ``produce()`` on a thread of its own, up to ``depth`` items ahead: reading and cutting a file (the cut
    runs without the GIL) overlap hashing and packing. Its error is raised here; ``close()`` stops it."""

    _END = object()

    def __init__(self, produce: Callable[[], Iterator[Any]], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(produce,), name="luopan-cdc", daemon=True)
        self._thread.start()

    def _run(self, produce: Callable[[], Iterator[Any]]) -> None:
        try:
            for item in produce():
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._error = exc
        finally:
            self._put_end()

    def _put_end(self) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(self._END, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> ahead:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is self._END:
            self._thread.join()
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def store_chunks(store: Store, config: RepoConfig, known: dict[str, BlobLocation],
                 intact: dict[str, tuple[int, ...]], chunks: Callable[[], Iterable[tuple[int, memoryview]]],
                 nsources: int, *, progress: Callable[[int], Any] | None = None,
                 crash_label: str = "chunk.written") -> Stored:
    """Write the chunks the repository lacks, of ``nsources`` sources: ``chunks()`` yields ``(source index, chunk
    bytes)`` in order (run on a thread of its own, a few chunks ahead of hashing). Chunks are hashed on every core,
    deduplicated against ``known`` (only where their pack is present and intact), packed, then named by one index
    file. ``Stored.rows[i]`` lists source ``i``'s chunks. On failure before the index file is visible, the packs
    written are deleted again (nothing can reference them yet). Every kind stores its chunks through here."""
    compression = config.compression
    writer = PackWriter(store, config.pack_size, intact)
    checker = PackChecker(store, intact)
    rows: list[list[tuple[str, int, str]]] = [[] for _ in range(nsources)]
    new: dict[str, tuple[PackBuilder, int, int, int, str]] = {}
    out = Stored(rows, {})
    index_name = None

    items = ahead(chunks, AHEAD)
    arenas = Arenas()

    def work(item: tuple[int, memoryview]) -> tuple[int, str, memoryview, int, str, str]:
        i, view = item
        h = blake3.blake3(view).hexdigest()
        x = xxhash.xxh3_128_hexdigest(view)
        if h in known:
            return i, h, view, len(view), "none", x  # deduplicated (unless its pack is gone: then copied below)
        # the element type of these chunks is not known here (file bytes, records, extents): zstd or none
        codec, stored = encode_blob(view, compression)
        return i, h, stored, len(view), codec, x  # a "none" chunk is copied into an arena below

    pool = ThreadPoolExecutor(WORKERS, "luopan-chunks")
    try:
        with pool:
            for i, h, stored, size, blob_codec, x in ordered_map(
                    pool, work, items, window=2 * WORKERS, inline=lambda item: len(item[1]) < INLINE_BYTES,
                    group=lambda item: len(item[1]), group_size=GROUP_BYTES):
                rows[i].append((h, size, x))
                if progress is not None:
                    progress(size)
                if h in new:
                    continue
                if h in known:
                    if checker.reusable(known[h]):
                        continue
                    del known[h]  # stale index entry: store the chunk again
                if blob_codec == "none":
                    stored = arenas.copy(stored)
                builder, off = writer.add(h, stored, size, blob_codec)
                new[h] = (builder, off, len(stored), size, blob_codec)
                out.new_bytes += size
                crashpoint(crash_label)
        writer.finish()
        if writer.written:
            index_id, index_bytes = build_index(writer.written, compress=config.format_version >= ENGINE2_FORMAT_VERSION)
            index_name = index_key(index_id)
            store.put_if_absent(index_name, index_bytes)
    except BaseException:
        items.close()
        writer.close()
        if index_name is None or not exists_quietly(store, index_name):
            writer.discard()
        raise
    writer.close()
    for h, (builder, off, length, size, blob_codec) in new.items():
        out.new_locations[h] = BlobLocation(builder.pack_id, off, length, size, blob_codec)
    out.locations = {h: out.new_locations.get(h) or known[h] for r in rows for h, _s, _x in r}
    out.index_key = index_name
    out.new_chunks = len(new)
    out.stored_bytes = writer.stored_bytes
    out.new_packs = len(writer.written)
    return out

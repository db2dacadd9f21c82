"""The one chunk writer every kind stores chunks through (docs/format.md §6, §7, §10): hash (BLAKE3 address, XXH3-128
change detector) on every core → deduplicate against the repository's chunk index (only where the pack is present
and intact) → codec → pack (written on background threads) → one index file naming the new packs.

The crash rule lives here and only here: until the index file naming this writer's packs is visible, nothing can
reference them, so a writer that fails (or is abandoned) before that deletes the packs it created; once the index
file may be visible, other writers may deduplicate against them and they are left to garbage collection.

Kinds cut their own chunks (fixed spans of a tensor, content-defined spans of a file, extents of an array) and hand
them over as items ``(target, bytes, reuse, xxh3, extra)``:

- ``target`` — which row list the chunk belongs to (``rows[target]``; ``ChunkWriter.target()`` adds one);
- ``reuse`` — XXH3 reuse (§5.1): ``(blake3, size, xxh3)`` of the chunk at the same place in this process's previous
  write; when the chunk's XXH3-128 and size equal it, its BLAKE3 address is taken instead of computed;
- ``xxh3`` — a precomputed XXH3-128 (or None);
- ``extra`` — a delta item (§5.4): handed to ``prepare(item)``, which returns the bytes to store instead (e.g. this
  content XOR a base chunk, in a per-thread scratch buffer: copied when kept).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any

import blake3
import xxhash

from .._crash import crashpoint
from ..format import ENGINE2_FORMAT_VERSION
from ..errors import LuopanError
from ..format.config import RepoConfig
from ..format.index import build_index
from ..format.names import index_key
from ..format.pack import BlobLocation, PackBuilder
from ..store.base import Store
from .arenas import Arenas
from ..format.codecs import encode_blob
from .packwriter import PackChecker, PackWriter, exists_quietly
from .parallel import WORKERS, ordered_map, shared_pool

# (target, chunk bytes, reuse (blake3, size, xxh3) or None, precomputed xxh3 or None, delta item for prepare or None)
Item = tuple[int, memoryview, "tuple[str, int, str] | None", "str | None", Any]
Row = tuple[str, int, str]  # (blake3, raw size, xxh3) of one chunk
# An entry the codec did not pay for in the previous write is stored raw without asking it again, except about
# once in this many writes (stored_plainly).
RECHECK_EVERY = 16


def stored_plainly(prev: dict[str, Any] | None, path: str, counter: int) -> bool:
    """Whether an entry's chunks are stored as they are without asking the codec (``ChunkWriter.plain``): the codec
    did not pay for any of them in the previous write (every row of ``prev``, the entry as its manifest listed it,
    stored raw; docs/format.md §6.1). Asking costs a sample of each chunk (~0.1 ms of Python and NumPy per chunk,
    whatever its size: 0.3-0.4 s of a LoRA re-save of 2,048 small changed tensors that stores 17-31 MB). The codec
    is asked again for about one write in RECHECK_EVERY of each such entry (spread over entries by ``path`` and over writes by ``counter``: a step, or a
    count of writes), so content that starts compressing is noticed."""
    if not prev or "xor" in prev or "delta" in prev:
        return False
    rows = prev.get("chunks")
    if not rows or any(r[5] != "none" for r in rows):
        return False
    return zlib.crc32(f"{path}\0{counter}".encode()) % RECHECK_EVERY != 0  # spread, not secret


class ChunkWriter:
    """One write's chunks: ``write(items)`` (any number of times), ``add`` for a blob hashed elsewhere, then
    ``write_index()`` (the packs become referenceable), or ``abandon()`` on failure. ``rows[t]`` lists target ``t``'s
    chunks in order; ``location(h)`` is where any of them is. Open one with ``Transaction.chunks()`` (it is then
    abandoned or learned by the repository with the transaction), or directly for a write outside one."""

    def __init__(self, store: Store, config: RepoConfig, known: dict[str, BlobLocation],
                 intact: dict[str, tuple[int, ...]], *, progress: Callable[[int], Any] | None = None,
                 crash_label: str = "chunk.written", copy_raw: bool = False, targets: int = 0) -> None:
        self.store, self.config, self.known = store, config, known
        self.progress, self.crash_label = progress, crash_label
        self.writer = PackWriter(store, config.pack_size, intact)
        self.checker = PackChecker(store, intact)
        # copy_raw: stored-as-is chunks are copied into pooled arenas (the caller reuses its read buffers)
        self._arenas = Arenas() if copy_raw else None
        self.new: dict[str, tuple[PackBuilder, int, int, int, str]] = {}  # hash -> (builder, offset, len, size, codec)
        self.new_locations: dict[str, BlobLocation] = {}
        self.new_bytes = 0
        self.stored_by_target: dict[int, int] = {}  # bytes of new blobs per target
        self.rows: list[list[Row]] = [[] for _ in range(targets)]
        self.itemsizes: list[int] = [0] * targets  # element width of a target's bytes for the float codec (0: unknown)
        # targets whose chunks are stored as they are without asking the codec (it did not pay for them last time)
        self.plain: set[int] = set()
        self.index_key: str | None = None
        self.indexed = False  # the index file's put returned: the packs are the repository's from here
        self.abandoned = False
        self._closed = False

    # -- targets and locations ------------------------------------------------------------------------------------
    def target(self, itemsize: int = 0, plain: bool = False) -> int:
        """A new row list; returns its number. ``plain``: store its chunks as they are, without trying the
        repository's codec (the caller knows it did not pay for this content last time)."""
        self.rows.append([])
        self.itemsizes.append(itemsize)
        if plain:
            self.plain.add(len(self.rows) - 1)
        return len(self.rows) - 1

    def reusable(self, h: str) -> bool:
        """Whether the stored chunk ``h`` may be referenced (known, its pack present and intact)."""
        loc = self.known.get(h)
        return loc is not None and self.checker.reusable(loc)

    def location(self, h: str) -> BlobLocation:
        return self.new_locations.get(h) or self.known[h]

    @property
    def stored_bytes(self) -> int:
        return self.writer.stored_bytes

    @property
    def new_packs(self) -> int:
        return len(self.writer.written)

    @property
    def new_chunks(self) -> int:
        return len(self.new)

    # -- the pipeline ---------------------------------------------------------------------------------------------
    def digest(self, view: memoryview, reuse: Row | None, x: str | None, itemsize: int = 0,
               fast: bool = False, plain: bool = False) -> tuple[str, memoryview, int, str, str]:
        """(blake3, bytes to store, raw size, codec, xxh3) of one chunk; encoded only when the repository lacks it
        (and not ``plain``)."""
        if x is None:
            x = xxhash.xxh3_128_hexdigest(view)  # ~2x BLAKE3's speed here: the cheap change detector
        if reuse is not None and reuse[2] == x and reuse[1] == len(view):
            h = reuse[0]  # unchanged since this process's previous write: its content address stands (§5.1)
        else:
            h = blake3.blake3(view).hexdigest()
        if h in self.known or plain:
            return h, view, len(view), "none", x  # deduplicated (unless its pack is gone: then stored below)
        codec, stored = encode_blob(view, self.config.compression, itemsize, fast)
        return h, stored, len(view), codec, x

    def _work(self, prepare: Callable[[Item], memoryview] | None) -> Callable[[Item], tuple[Any, ...]]:
        itemsizes, plain = self.itemsizes, self.plain

        def work(item: Item) -> tuple[Any, ...]:
            t, view, reuse, x, extra = item
            itemsize = itemsizes[t] if t < len(itemsizes) else 0
            if extra is None or prepare is None:
                return (t, *self.digest(view, reuse, x, itemsize, plain=t in plain))
            view = prepare(item)  # a delta item, in this thread's scratch: copied when it is kept
            h, stored, size, codec, x = self.digest(view, reuse, x, itemsize, fast=True)
            return t, h, memoryview(bytes(stored)) if codec == "none" else stored, size, codec, x
        return work

    def write(self, items: Iterable[Item], *, prepare: Callable[[Item], memoryview] | None = None,
              inline_bytes: int = 0, group_bytes: int = 0) -> None:
        """Hash ``items`` on every core (chunks under ``inline_bytes`` on this thread; others handed to a worker in
        groups of up to ``group_bytes``), in order, and pack those the repository lacks. On failure the packs this
        writer created are deleted (``abandon``) and the error is raised."""
        known, writer, rows, new, progress = self.known, self.writer, self.rows, self.new, self.progress
        inline = (lambda item: len(item[1]) < inline_bytes) if inline_bytes else None
        group = (lambda item: len(item[1])) if group_bytes else None
        try:
            pool = shared_pool("chunks")
            for t, h, stored, size, codec, x in ordered_map(pool, self._work(prepare), items, window=2 * WORKERS,
                                                           inline=inline, group=group, group_size=group_bytes):
                rows[t].append((h, size, x))
                if progress is not None:
                    progress(size)
                if h in new:
                    continue
                if h in known:
                    if self.checker.reusable(known[h]):
                        continue
                    del known[h]  # stale index entry: store the chunk again
                if codec == "none" and self._arenas is not None:
                    stored = self._arenas.copy(stored)
                self._add(h, stored, size, codec)
                self.stored_by_target[t] = self.stored_by_target.get(t, 0) + len(stored)
                crashpoint(self.crash_label)
            writer.finish()
        except BaseException:
            self.abandon()
            raise
        self._locate()

    def add(self, h: str, stored: memoryview, size: int, codec: str) -> None:
        """Pack one blob hashed and encoded by the caller (e.g. a manifest's entry group), unless already added."""
        if h not in self.new:
            self._add(h, stored, size, codec)

    def _add(self, h: str, stored: memoryview, size: int, codec: str) -> None:
        builder, off = self.writer.add(h, stored, size, codec)
        self.new[h] = (builder, off, len(stored), size, codec)
        self.new_bytes += size

    def flush(self) -> None:
        """Make every pack added so far durable (locations of ``add``-ed blobs are known from here)."""
        try:
            self.writer.finish()
        except BaseException:
            self.abandon()
            raise
        self._locate()

    def _locate(self) -> None:
        for h, (builder, off, length, size, codec) in self.new.items():
            if h not in self.new_locations:
                assert builder.pack_id is not None
                self.new_locations[h] = BlobLocation(builder.pack_id, off, length, size, codec)

    # -- the crash rule -------------------------------------------------------------------------------------------
    def write_index(self) -> str | None:
        """Flush the last pack and store the one index file naming every pack this writer created (none: no file).
        From here the packs are the repository's: another writer may deduplicate against them."""
        if self.abandoned:
            raise LuopanError("this chunk writer was abandoned (its packs may be deleted): write the chunks again")
        try:
            self.writer.finish()
            self._locate()
            if self.writer.written:
                index_id, data = build_index(self.writer.written,
                                             compress=self.config.format_version >= ENGINE2_FORMAT_VERSION)
                self.index_key = index_key(index_id)
                self.store.put_if_absent(self.index_key, data)
        except BaseException:
            self.abandon()
            raise
        self.indexed = True
        self.close()
        return self.index_key

    def abandon(self) -> None:
        """Stop; delete the packs this writer created unless an index file naming them may be visible (even if its
        put then failed, e.g. in the directory fsync: from then on they are left to garbage collection)."""
        if self.abandoned:
            return
        self.close()
        self.abandoned = True
        if not self.indexed and (self.index_key is None or not exists_quietly(self.store, self.index_key)):
            self.writer.discard()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()

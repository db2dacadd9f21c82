"""Storing the chunks of sources cut by a kind (files, records, extents) through the chunk writer: the cut runs on a
thread of its own, a few chunks ahead of hashing (docs/format.md §6, §7, §10)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .chunkwriter import ChunkWriter

AHEAD = 64  # chunks cut ahead of hashing
INLINE_BYTES = 64 << 10  # smaller chunks are hashed on the calling thread (a handoff costs more)
GROUP_BYTES = 8 << 20


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


def store_chunks(chunks: ChunkWriter, produce: Callable[[], Iterable[tuple[int, memoryview]]],
                 nsources: int) -> ChunkWriter:
    """Store the chunks of ``nsources`` sources through ``chunks`` (a ChunkWriter with no targets yet), then its index
    file: ``produce()`` yields ``(source index, chunk bytes)`` in order, run on a thread of its own a few chunks ahead
    of hashing. Returns ``chunks``, indexed: ``chunks.rows[i]`` lists source ``i``'s chunks, ``chunks.location(h)``
    says where each is. The crash rule is the chunk writer's."""
    for _ in range(nsources):
        chunks.target()
    items = ahead(lambda: ((i, view, None, None, None) for i, view in produce()), AHEAD)
    try:
        chunks.write(items, inline_bytes=INLINE_BYTES, group_bytes=GROUP_BYTES)
    finally:
        items.close()
    chunks.write_index()
    return chunks

"""Pooled memory for chunk bytes: read buffers reused once nothing refers to them, and arenas new chunks are copied
into for their packs (luopan.repository.chunkwriter)."""

from __future__ import annotations

import sys

import numpy as np

ARENA = 16 << 20  # bytes of new chunks copied into one pooled buffer


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

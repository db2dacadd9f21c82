"""Filling the inverted lists of a loading IVF index from its segments (docs/format.md §17.2, §17.6).

Each list is its own faiss vector, and sizing one zero-fills it: on the index of this project's benchmark that
costs a third of what reading and verifying its chunks costs, and it used to run alone before any chunk was read. So
the lists are sized one by one, in order, on a thread of their own, while the workers read and verify the segments'
chunks (BLAKE3, zstd, reads and faiss's resize all release the GIL); a verified chunk is copied into the lists it
covers as soon as they are sized, and a chunk that lies in one list is read and verified straight into it.
"""

from __future__ import annotations

import bisect
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format.manifest import Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk
from ..repository.parallel import WORKERS
from ..store.base import Store
from .extents import _scratch  # this thread's scratch buffer

if TYPE_CHECKING:  # pragma: no cover  (faiss_codec imports faiss: only a load that needs it does)
    from .faiss_codec import Unsized



class _Sizing:
    """The lists of one node sized in order on a thread; ``views(last)`` waits until lists 0..last are sized."""

    def __init__(self, node: Unsized, totals: list[int]) -> None:
        self.views: list[tuple[memoryview, memoryview]] = []
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(node, totals), name="luopan-index-size", daemon=True)
        self._thread.start()

    def _run(self, node: Unsized, totals: list[int]) -> None:
        try:
            for i, n in enumerate(totals):
                v = node.size(i, n)
                with self._cond:
                    self.views.append(v)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised by the readers waiting on it, and by join()
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def wait(self, last: int) -> list[tuple[memoryview, memoryview]]:
        with self._cond:
            self._cond.wait_for(lambda: len(self.views) > last or self.error is not None)
            if self.error is not None:
                raise self.error
            return self.views

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


def fill_lists(store: Store, owner: str, doc: dict[str, Any], entries: dict[str, dict[str, Any]], node: Unsized,
               counts: np.ndarray) -> None:
    """Size ``node``'s lists by ``counts`` (checked: ``ivf.check_counts``) and read every segment's chunks into them,
    each verified before it is copied (or verified where it was read, for a chunk within one list)."""
    p = node.prefix + "ivf/"
    packs = doc["packs"]
    jobs: list[tuple[ChunkRef, list[int], list[int], int, int, int]] = []
    for k in range(len(counts)):
        before = counts[:k].sum(axis=0)
        for part, width, side in (("codes", node.code_size, 0), ("ids", 8, 1)):
            seg = [0, *np.cumsum(counts[k] * width).tolist()]  # list i's slice: seg[i]..seg[i + 1] of the segment
            at = (before * width).tolist()  # where segment k starts inside each list, in bytes
            entry = entries[f"{p}{k}/{part}"]
            off = 0
            for n, r in enumerate(map(Row._make, entry["chunks"])):
                ref = ChunkRef(owner, entry["path"], n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)
                jobs.append((ref, seg, at, side, off, k))
                off += r.size
    sizes = PackSizes(store)
    sizes.prefetch({job[0].pack for job in jobs})
    sizing = _Sizing(node, counts.sum(axis=0).tolist())

    def one(job: tuple[ChunkRef, list[int], list[int], int, int, int]) -> None:
        ref, seg, at, side, off, _k = job
        end = off + ref.size
        if ref.size == 0:
            return
        sizes.check(ref)  # before anything is sized by the row
        first = bisect.bisect_right(seg, off) - 1
        last = bisect.bisect_left(seg, end) - 1  # the list holding the chunk's last byte (rows sum to seg[-1]:
        if first == last:  # parse_index_manifest and check_counts) -- within one list: read and verified in place
            views = sizing.wait(last)
            dest = views[first][side]
            a = at[first] + off - seg[first]
            read_chunk(store, ref, dest[a:a + ref.size], sizes)
            return
        tmp = _scratch(ref.size)
        read_chunk(store, ref, tmp, sizes)  # verified before any byte reaches the index
        views = sizing.wait(last)
        pos, i = off, first
        while pos < end:
            stop = min(end, seg[i + 1])
            if stop > pos:
                a = at[i] + pos - seg[i]
                views[i][side][a:a + stop - pos] = tmp[pos - off:stop - off]
            pos, i = stop, i + 1

    try:
        with ThreadPoolExecutor(WORKERS, "luopan-index-fill") as pool:
            list(pool.map(one, jobs))
    finally:
        sizing.join()

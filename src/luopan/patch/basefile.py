"""A plain safetensors file as a patch's base: every tensor cut into §5 chunks at the patch's chunk size and hashed,
read in pieces of one chunk (never the whole file, never mapped), which gives its content fingerprint and where each
chunk of it lies."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3

from .._parallel import ordered_map
from ..errors import CorruptPatchError, CorruptSafetensorsError
from .fingerprint import content_fingerprint
from .files import read_exact, workers_for
from .header import spans
from .stfile import FileTensor, read_header

# Chunks of a base that are hashed at most: 1 TiB at 4 MiB chunks, ~80 MiB of hashes and locations. The chunk size
# comes from the patch, so a hostile one (4 KiB) could otherwise make a big base cost gigabytes of bookkeeping.
MAX_BASE_CHUNKS = 1 << 18
_tls = threading.local()


def scratch(size: int) -> memoryview:
    """This thread's reusable buffer, at least ``size`` bytes (one chunk)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        _tls.buf = buf = bytearray(size)
    return memoryview(buf)[:size]


@dataclass
class HashedFile:
    path: str
    tensors: list[FileTensor]
    hashes: list[list[str]]  # per tensor, its chunk hashes
    fingerprint: str
    where: dict[str, tuple[int, int]]  # chunk hash -> (absolute offset, size), one place per hash

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def hash_file(fd: int, path: str, chunk_size: int, progress: Callable[[int], Any] | None = None,
              land: Callable[[str, memoryview], None] | None = None) -> HashedFile:
    """Hash the safetensors file open at ``fd``. CorruptSafetensorsError when it is not a valid one (or shrinks).
    ``land(hash, chunk)`` is called on the hashing thread with each chunk's bytes just hashed (valid only during the
    call): ``patch apply`` writes them where the target needs them, so the base is read and hashed once."""
    size = os.fstat(fd).st_size
    tensors, _metadata = read_header(fd, size, path)
    cuts = [spans(t.nbytes, t.shape, chunk_size) for t in tensors]
    total = sum(count for _step, count in cuts)
    if total > MAX_BASE_CHUNKS:
        raise CorruptPatchError(f"the patch cuts {path} into {total} chunks of {chunk_size} bytes; at most "
                                f"{MAX_BASE_CHUNKS} are hashed (a patch for a base this large uses bigger chunks)")

    def jobs() -> Iterator[tuple[int, int, int]]:  # (tensor index, absolute offset, size), made as they are hashed
        for i, (t, (step, count)) in enumerate(zip(tensors, cuts, strict=True)):
            for k in range(count):
                yield i, t.offset + k * step, min(step, t.nbytes - k * step)

    def one(job: tuple[int, int, int]) -> tuple[int, int, int, str]:
        i, offset, n = job
        buf = scratch(n)
        if read_exact(fd, buf, offset) != n:
            raise CorruptSafetensorsError(f"{path} became shorter while it was read")
        digest = blake3.blake3(buf).hexdigest()
        if land is not None:
            land(digest, buf)
        if progress is not None:
            progress(n)
        return i, offset, n, digest

    hashes: list[list[str]] = [[] for _ in tensors]
    where: dict[str, tuple[int, int]] = {}
    workers = workers_for(chunk_size)
    with ThreadPoolExecutor(workers, "luopan-patch-hash") as pool:
        for i, offset, n, h in ordered_map(pool, one, jobs(), window=2 * workers):
            hashes[i].append(h)
            where.setdefault(h, (offset, n))
    fp = content_fingerprint(chunk_size, ((t.name, t.dtype, t.shape, hs)
                                          for t, hs in zip(tensors, hashes, strict=True)))
    return HashedFile(path, tensors, hashes, fp, where)

"""Storing an artifact's files: content-defined chunks (FastCDC), hashed on every core, deduplicated against the
repository, packed, then indexed (docs/format.md §5.3, §10)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from pyfastcdc import FastCDC

from ..repository.arenas import BufferPool
from ..repository.chunkstore import store_chunks
from ..repository.chunkwriter import ChunkWriter
from .sources import Source

# FastCDC sizes (docs/format.md §5.3): an insertion costs its own bytes plus about two average chunks around it.
CDC_MIN = 64 << 10
CDC_AVG = 256 << 10
CDC_MAX = 1 << 20
READ_BLOCK = 16 << 20  # bytes read from a file at a time (memory per file in flight stays bounded)
SMALL_FILE = 1 << 20  # files up to this size are read whole, each into its own bytes object


def _cdc() -> FastCDC:
    return FastCDC(avg_size=CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX)


def cdc_chunks(stream: BinaryIO, size_hint: int | None = None, pool: BufferPool | None = None
               ) -> Iterator[memoryview]:
    """The content-defined chunks of a stream, read in blocks; a chunk cut only by a block's end is carried over, so
    the cuts are those of the whole stream (each chunk's cut depends only on the bytes from its start). Each block is
    read straight into a free buffer of ``pool`` (the chunks handed out are views of it); ``size_hint`` (the file's
    size) keeps buffers of small files small."""
    if size_hint is not None and size_hint <= SMALL_FILE:  # one read into its own bytes: no pooling needed
        data = memoryview(stream.read())  # to the end, even if it grew since it was listed
        if data:
            yield from (data[c.offset : c.offset + c.length] for c in _cdc().cut_buf(data))
        return
    pool = pool or BufferPool()
    cdc = FastCDC(avg_size=CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX)
    carry = memoryview(b"")
    left = READ_BLOCK if size_hint is None else max(size_hint, 1)
    eof = False
    while not eof:
        want = min(READ_BLOCK, left) if left > 0 else READ_BLOCK  # past the hint (a file that grew): full blocks
        end = len(carry) + want
        view = pool.get(end)
        view[: len(carry)] = carry
        filled = len(carry)
        carry = memoryview(b"")
        while filled < end:
            n = stream.readinto(view[filled:end])
            if not n:
                eof = True
                break
            filled += n
        left -= filled
        view = view[:filled]
        if not filled:
            return
        cuts = [(c.offset, c.length) for c in cdc.cut_buf(view)]
        if not eof:  # the last chunk may have been cut by the block's end: carry it into the next block
            *cuts, (last_off, _last_len) = cuts
            carry = view[last_off:]
        for off, length in cuts:
            yield view[off : off + length]


def store_sources(chunks: ChunkWriter, sources: list[Source]) -> ChunkWriter:
    """Write the chunks of every file source the repository lacks through ``chunks`` (packs, then one index file)."""
    buffers = BufferPool()

    def produce() -> Iterator[tuple[int, memoryview]]:
        for i, src in enumerate(sources):
            if src.size == 0 and src.data is None:
                continue
            with src.open() as f:
                for chunk in cdc_chunks(f, src.size, buffers):
                    yield i, chunk

    return store_chunks(chunks, produce, len(sources))

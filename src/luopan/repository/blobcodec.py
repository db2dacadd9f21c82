"""How a chunk is stored in a pack: its codec (docs/format.md §6). One place for the encoders and decoders, used by
every writer (checkpoints, parts, artifacts, journals, indexes) and every reader (loads, verify, repack)."""

from __future__ import annotations

import threading

import zstandard

from ..errors import CorruptPackError
from ..format.config import Compression

_tls = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor at ``level`` (compressors are not thread-safe; making one costs ~50 us)."""
    c = getattr(_tls, "zstd", None)
    if c is None or _tls.zstd_level != level:
        c = _tls.zstd = zstandard.ZstdCompressor(level=level)
        _tls.zstd_level = level
    return c


def encode_blob(view: memoryview, compression: Compression, itemsize: int = 0) -> tuple[str, memoryview]:
    """(codec, stored bytes) for one chunk. ``itemsize`` is the width of the chunk's elements when they are known to
    be numbers of one type (2 for bf16/fp16, 4 for fp32, ...), 0 when unknown. Returns ``("none", view)`` when no
    codec makes the chunk smaller."""
    if compression.codec == "zstd":
        z = compressor(compression.level).compress(view)
        if len(z) < len(view):
            return "zstd", memoryview(z)
    return "none", view


def decode_blob(codec: str, data: bytes | memoryview, size: int, where: str) -> bytes:
    """The raw bytes of a stored blob (exactly ``size`` of them); CorruptPackError names ``where`` on damage."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptPackError(f"corrupt compressed blob: {where}: {exc}") from None
    if len(raw) != size:
        raise CorruptPackError(f"corrupt compressed blob: {where} decompressed to {len(raw)} bytes")
    return raw

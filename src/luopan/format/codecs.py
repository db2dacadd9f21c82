"""How a chunk is stored in a pack: its codec (docs/format.md §6, §6.1). One place for the encoders and decoders, used
by every writer (checkpoints, parts, artifacts, journals, indexes) and every reader (loads, verify, repack)."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ..errors import CorruptPackError
from .config import Compression
from . import bytegroup
from . import planes

_tls = threading.local()

# "auto" compresses a chunk only when a sample of it shrinks by at least this much (docs/format.md §6.1). Measured
# (benchmarks/floatcodec.py, GPT-2-shaped default-init weights, 2 cores): bytegroup shrinks bf16 weights by 35% at
# ~0.4 GB/s per core; fp32 and fp16 weights and random-normal fp32 only by 17-18% for the same work per byte, so
# they are stored raw, and the foundation benchmark (P1, random fp32) saves as fast as with compression off.
AUTO_MIN_SAVING = 0.25
# The sample: SAMPLES slices spread over the chunk, SAMPLE_BYTES in all. 16 KiB per 4 MiB chunk of random fp32 costs
# ~0.04 ms of one core (one histogram), against ~0.5 ms to BLAKE3-hash the chunk.
SAMPLE_BYTES = 16 << 10
SAMPLES = 4
# A plane is coded only when its sample says coding saves at least this much of it. A bf16 mantissa plane saves
# <0.1%; the low planes of drifted fp32 values save 3-15% but Huffman-decode at ~450 MB/s (2.3 ms per MiB with ISA-L,
# for ~0.13 MB less to read): with them coded (3%), P4's restore of save #100 took 3.25x that of save #1; with them raw
# and the chunk rule below counting them raw, 1.26x, for +1.5% of that repository's size. Exponent planes (bf16
# ~60%, drifted fp32 ~80%) and XOR planes save far more, so P13 and P14 sizes do not change.
PLANE_MIN_SAVING = 0.15
# Nibbles when 15 consecutive values hold this much of a plane's sample: each escaped byte costs 4 bits + 8 bits.
NIBBLE_MIN_SHARE = 0.995


# XOR-delta chunks (docs/format.md §5.4) code their planes with zstd tuned to do little more than entropy-code
# literals (the fast strategy with a tiny hash table and long minimum matches), instead of deflate's Huffman codes
# or zstd at the repository's level: the same zstd frames for readers, written ~2x and read ~1.6x faster. Measured
# on the XOR of a mixed-precision fine-tune's bf16 weights 2 saves apart (4 MiB chunks, one core): the low plane
# 3.5 ms for 37.2% of its size against 6.3 ms for 34.6% (deflate), the exponent plane 1.3 ms for 3.2% (the same as
# zstd level 3). A full fine-tune writes such a chunk for every chunk it changes at every save, so its save time is
# mostly this coding; weights stored in full keep the denser codings (P14 compares them with ZipNN). XOR chunks
# are also split without the sign rotation (transform 0): an XOR's sign bit is nearly always 0, so leaving it on top
# of the exponent's XOR costs nothing, and the split and the decode skip three passes (same chunks: 20.2% -> 19.8%
# of their size, planes coded in 4.5 instead of 5.0 ms).
FAST_PARAMS = zstandard.ZstdCompressionParameters(window_log=17, hash_log=8, min_match=7, search_log=1,
                                                  strategy=zstandard.STRATEGY_FAST)


def fast_compressor() -> zstandard.ZstdCompressor:
    """This thread's zstd compressor with FAST_PARAMS."""
    c = getattr(_tls, "zstd_fast", None)
    if c is None:
        c = _tls.zstd_fast = zstandard.ZstdCompressor(compression_params=FAST_PARAMS)
    return c


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor at ``level`` (compressors are not thread-safe; making one costs ~50 us)."""
    c = getattr(_tls, "zstd", None)
    if c is None or _tls.zstd_level != level:
        c = _tls.zstd = zstandard.ZstdCompressor(level=level)
        _tls.zstd_level = level
    return c


def sample(view: memoryview | bytes, width: int = 1) -> memoryview | bytes:
    """About SAMPLE_BYTES of ``view`` from SAMPLES evenly spaced places, each starting on an element (the whole chunk
    when it is that small)."""
    n = len(view)
    if n <= SAMPLE_BYTES:
        return view
    piece = SAMPLE_BYTES // SAMPLES // width * width
    starts = [(n - piece) * k // (SAMPLES - 1) // width * width for k in range(SAMPLES)]
    return b"".join(view[s : s + piece] for s in starts)


def float_codings(view: memoryview | bytes, width: int, level: int, fast: bool = False) -> list[int] | None:
    """How to store each byte plane of a float chunk (planes.RAW / NIBBLES / ZSTD / DEFLATE), or None when a sample
    says the chunk would not shrink by AUTO_MIN_SAVING. A plane worth coding takes nibbles when 15 consecutive
    values hold nearly all of it (Huffman codes of nibble pairs: half the work, closer to the entropy); else
    deflate's Huffman codes of its bytes; zstd instead of either where the sample shows it does better (repetition).
    With ``fast`` (XOR-delta chunks) every plane worth coding takes zstd (FAST_PARAMS), and the planes are not
    rotated (transform 0)."""
    s = sample(view, width)
    m = len(s) // width
    entropies, shares = bytegroup.plane_stats(s, width, rotate=not fast)
    coded = entropies <= m * (1 - PLANE_MIN_SAVING)  # the planes worth coding; the others are stored raw
    if m == 0 or float(np.where(coded, entropies, m).sum()) > len(s) * (1 - AUTO_MIN_SAVING):
        return None  # the chunk, as it would be stored, does not shrink enough
    if fast:
        return [planes.ZSTD if c else planes.RAW for c in coded]
    codings = []
    for j, plane in enumerate(bytegroup.split(s, width)):
        if not coded[j]:
            codings.append(planes.RAW)
            continue
        # Huffman codes: one bit per symbol at least, a symbol being a byte, or a pair of nibbles
        nibbles = shares[j] >= NIBBLE_MIN_SHARE
        huffman = max(entropies[j] * 1.02, m / (16 if nibbles else 8))
        z = len(compressor(level).compress(plane))
        codings.append(planes.ZSTD if z < huffman else planes.NIBBLES if nibbles else planes.DEFLATE)
    return codings


def _zstd(view: memoryview | bytes, level: int) -> tuple[str, memoryview | bytes]:
    z = compressor(level).compress(view)
    return ("zstd", memoryview(z)) if len(z) < len(view) else ("none", view)


def zstd_blob(view: memoryview | bytes, level: int = 3) -> tuple[str, memoryview | bytes]:
    """("zstd", frame) when one zstd frame is smaller, else ("none", view): whatever the repository's compression
    (a manifest's entry groups are always compressed, as manifests are: docs/format.md §8.5)."""
    return _zstd(view, level)


def encode_blob(view: memoryview, compression: Compression, itemsize: int = 0,
                fast: bool = False) -> tuple[str, memoryview]:
    """(codec, stored bytes) for one chunk. ``itemsize`` is the width of the chunk's elements when they are known to
    be floating-point numbers (2 for bf16/fp16, 4 for fp32, 8 for fp64), 0 when not. Returns ``("none", view)`` when
    no codec makes the chunk smaller (and, for "auto", when a sample says compressing would not pay). ``fast``: an
    XOR-delta chunk of floats, whose planes "auto" codes with FAST_PARAMS."""
    codec = compression.codec
    if codec == "zstd":
        return _zstd(view, compression.level)  # type: ignore[return-value]
    if codec != "auto" or not len(view):
        return "none", view
    if itemsize in bytegroup.WIDTHS and len(view) >= itemsize:
        codings = float_codings(view, itemsize, compression.level, fast)
        if codings is None:
            return "none", view
        stored = bytegroup.encode(view, itemsize, codings,
                                  fast_compressor() if fast else compressor(compression.level), rotate=not fast)
        return ("bytegroup", memoryview(stored)) if len(stored) < len(view) else ("none", view)
    s = sample(view)
    z = compressor(compression.level).compress(s)
    if len(z) > len(s) * (1 - AUTO_MIN_SAVING):
        return "none", view
    if s is view:
        return "zstd", memoryview(z)
    return _zstd(view, compression.level)  # type: ignore[return-value]


def decode_blob(codec: str, data: bytes | memoryview, size: int, where: str,
                out: memoryview | None = None) -> bytes | memoryview:
    """The raw bytes of a stored blob (exactly ``size`` of them); CorruptPackError names ``where`` on damage. Never
    allocates more than about twice ``size`` (the result and the decoded planes), whatever the stored bytes
    declare. With ``out`` (``size`` writable
    bytes) a bytegroup blob is decoded straight into it, and ``out`` is returned; other codecs are copied into it."""
    if out is not None:
        if codec == "bytegroup":
            return bytegroup.decode(data, size, where, out)
        out[:] = decode_blob(codec, data, size, where)
        return out
    if codec == "none":
        if len(data) != size:
            raise CorruptPackError(f"corrupt blob: {where} has {len(data)} bytes, not {size}")
        return data
    if codec == "bytegroup":
        return bytegroup.decode(data, size, where)
    if codec != "zstd":
        raise CorruptPackError(f"unknown codec {codec[:20]!r}: {where}")
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, size):
            raise CorruptPackError(f"corrupt compressed blob: {where} declares {declared} bytes, not {size}")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptPackError(f"corrupt compressed blob: {where}: {exc}") from None
    if len(raw) != size:
        raise CorruptPackError(f"corrupt compressed blob: {where} decompressed to {len(raw)} bytes")
    return raw


"""How one byte plane of a bytegroup blob is stored (docs/format.md §6.1): raw, a zstd frame, a raw deflate stream,
or nibbles. Decoders are strict: a plane decodes to exactly its size or raises, and never allocates more than that.

The exponent plane of model weights is nearly independent bytes of ~2-3 bits of entropy taking a dozen values:
only an entropy coder compresses it. zstd's matcher does badly there, turning the frequent short runs of the
commonest exponent into sequences that cost more than the literals they replace; Huffman codes alone (deflate's
Huffman-only mode) come close to the entropy. Measured on bf16 exponents of a default-init 2048 x 1024 linear layer
(entropy 28.57% of the plane): zstd level 1 34.3%, Huffman-only deflate of the bytes 29.46%; nibbles, i.e. offsets
from a base value packed two per byte, then Huffman-only deflate: 28.87% in half the Huffman work (half as many
symbols), decoded twice as fast; the same nibbles under zstd level 1 (Huffman literals, codes of at most 11 bits):
29.11%, and 25.67% against deflate's 25.33% where the distribution is dyadic (uniform init of bound 2^-5), so deflate
it is. Plain deflate stays for planes of more than 15 common values (fp16's top byte), zstd for repetitive ones.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

try:  # zlib-ng: the same raw deflate streams (RFC 1951), coded twice as fast (412 vs 200 MB/s Huffman-only here)
    from zlib_ng import zlib_ng as zlib
except ImportError:  # pragma: no cover - the stdlib's zlib reads and writes the same format, slower
    import zlib  # type: ignore[no-redef]
try:  # ISA-L reads the same raw deflate streams 2.5x faster than zlib-ng here (0.9 vs 2.2 ms per 1 MiB exponent plane)
    from isal import isal_zlib as _inflater

    _INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _inflater.error)
except ImportError:  # pragma: no cover - zlib-ng inflates the same streams, slower
    _inflater = zlib  # type: ignore[assignment]
    _INFLATE_ERRORS = (zlib.error,)

RAW, ZSTD, DEFLATE, NIBBLES = 0, 1, 2, 3
CODINGS = (RAW, ZSTD, DEFLATE, NIBBLES)
ESCAPE = 15  # the nibble of a byte outside base .. base + 14, stored after the nibbles' stream
_NIBBLE_HEAD = struct.Struct("<BI")  # base, number of escaped bytes


def best_base(counts: np.ndarray) -> tuple[int, float]:
    """(base, share): the 15 consecutive byte values ``base .. base + 14`` (wrapping at 256) holding the largest share
    of a histogram's counts."""
    total = float(counts.sum())
    if total == 0:
        return 0, 1.0
    windows = np.convolve(np.concatenate([counts, counts[:14]]), np.ones(15), "valid")[:256]
    base = int(np.argmax(windows))
    return base, float(windows[base]) / total


def deflate(plane: np.ndarray) -> bytes:
    """A raw deflate stream (RFC 1951) of ``plane``, Huffman codes only (no string matching)."""
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(plane) + c.flush()


def _nibbles(plane: np.ndarray) -> bytes:
    m = len(plane)
    base, _share = best_base(np.bincount(plane[:: max(1, m // 65536)], minlength=256))
    d = np.empty(m + (m & 1), np.uint8)
    d[m:] = 0
    np.subtract(plane, np.uint8(base), out=d[:m])
    np.minimum(d, np.uint8(ESCAPE), out=d)
    is_escape = d[:m] == ESCAPE
    escaped = plane[is_escape] if is_escape.any() else plane[:0]
    v = d.view("<u2")  # each pair (even, odd) as one little-endian u16: even in the low byte
    packed = np.empty(len(v), np.uint8)
    np.copyto(packed, (v << 4) | (v >> 8), casting="unsafe")  # even in the high nibble, odd in the low one
    return _NIBBLE_HEAD.pack(base, len(escaped)) + deflate(packed) + escaped.tobytes()


def encode_plane(plane: np.ndarray, coding: int, zstd: zstandard.ZstdCompressor) -> tuple[int, bytes | np.ndarray]:
    """(coding, stored bytes) of one plane: RAW when the coding asked for would not make it smaller."""
    stored: bytes | np.ndarray = plane
    if coding == ZSTD:
        stored = zstd.compress(plane)
    elif coding == DEFLATE:
        stored = deflate(plane)
    elif coding == NIBBLES:
        stored = _nibbles(plane)
    if coding == RAW or len(stored) >= len(plane):
        return RAW, plane
    return coding, stored


class PlaneError(ValueError):
    """A plane that does not decode to its size (the caller names the blob)."""


def _zstd_exact(frame: memoryview, m: int) -> bytes:
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, m):
        raise PlaneError(f"declares {declared} bytes, not {m}")
    out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=m, allow_extra_data=False)
    if len(out) != m:
        raise PlaneError(f"decoded to {len(out)} bytes, not {m}")
    return out


def _inflate_exact(stream: memoryview, m: int) -> bytes:
    d = _inflater.decompressobj(-15)
    out = d.decompress(stream, m + 1)  # one byte more than allowed: too long reads as too long
    if not d.eof or d.unused_data or d.unconsumed_tail or len(out) != m:
        raise PlaneError(f"not one complete deflate stream of {m} bytes")
    return out


def _unnibble(stored: memoryview, m: int) -> np.ndarray:
    if len(stored) < _NIBBLE_HEAD.size:
        raise PlaneError("shorter than its nibble header")
    base, n_escaped = _NIBBLE_HEAD.unpack_from(stored)
    frame_end = len(stored) - n_escaped  # where the deflate stream of the nibbles ends
    if frame_end <= _NIBBLE_HEAD.size:
        raise PlaneError(f"{n_escaped} escaped bytes do not fit in {len(stored)}")
    packed = np.frombuffer(_inflate_exact(stored[_NIBBLE_HEAD.size : frame_end], (m + 1) // 2), np.uint8)
    v = (packed & 15).astype("<u2")
    v <<= 8
    v |= packed >> 4
    nib = v.view(np.uint8)  # even, odd, even, odd, ...
    if len(nib) > m and nib[m]:
        raise PlaneError("the padding nibble is not zero")
    nib = nib[:m]
    escapes = nib == ESCAPE
    found = int(np.count_nonzero(escapes))
    if found != n_escaped:
        raise PlaneError(f"{found} escape nibbles for {n_escaped} escaped bytes")
    plane = np.add(nib, np.uint8(base), out=nib)
    if n_escaped:
        escaped = np.frombuffer(stored[frame_end:], np.uint8)
        if np.any((escaped - np.uint8(base)) < ESCAPE):
            raise PlaneError("an escaped byte that has a nibble")
        plane[escapes] = escaped
    return plane


def decode_plane(coding: int, stored: memoryview, m: int) -> bytes | memoryview | np.ndarray:
    """Plane bytes, exactly ``m`` of them (never allocating more than ``m + 1``); PlaneError on damage."""
    if coding == RAW:
        if len(stored) != m:
            raise PlaneError(f"raw plane of {len(stored)} bytes, not {m}")
        return stored
    try:
        if coding == ZSTD:
            return _zstd_exact(stored, m)
        if coding == NIBBLES:
            return _unnibble(stored, m)
        if coding != DEFLATE:
            raise PlaneError(f"unknown coding {coding}")
        return _inflate_exact(stored, m)
    except (zstandard.ZstdError, *_INFLATE_ERRORS) as exc:
        raise PlaneError(str(exc)) from None


"""The ``bytegroup`` blob codec for floating-point chunks (docs/format.md §6.1): each element is rotated left by one
bit (the sign moves to bit 0, so the top byte holds the exponent's top 8 bits), the chunk's bytes are split into byte
planes (plane j = byte j of every element), and each plane is stored as planes.py says: raw, zstd, deflate or
nibbles. A header of 4 + 5 x width bytes says how, so decoding needs only the blob and the chunk's raw size.

Everything heavy here (NumPy shifts and copies, zstd, zlib) releases the GIL, so the writer's worker threads run
it on every core.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from ..errors import CorruptPackError
from .planes import CODINGS, RAW, PlaneError, best_base, decode_plane, encode_plane

VERSION = 1
WIDTHS = (2, 4, 8)
_HEAD = struct.Struct("<BBBB")  # version, width, transform, reserved
_PLANE = struct.Struct("<BI")  # coding, stored length
ROTATE = 1  # transform: every element rotated left by one bit before the split

_tls = threading.local()


def header_size(width: int) -> int:
    return _HEAD.size + width * _PLANE.size


def _scratch(name: str, n: int, dtype: str) -> np.ndarray:
    """A reusable per-thread array of ``n`` elements: fresh multi-MiB arrays cost a page fault per 4 KiB."""
    buf = getattr(_tls, name, None)
    if buf is None or buf.dtype != np.dtype(dtype) or len(buf) < n:
        buf = np.empty(max(n, 1), dtype)
        setattr(_tls, name, buf)
    return buf[:n]


def _rotated(data: memoryview | bytes, width: int, r: np.ndarray, t: np.ndarray, rotate: bool = True) -> np.ndarray:
    """The first ``len(data) // width`` elements rotated left by one bit, into ``r`` (``t``: scratch); with
    ``rotate`` False, copied as they are."""
    u = np.frombuffer(data, dtype=f"<u{width}", count=len(data) // width)
    if not rotate:
        np.copyto(r, u)
        return r
    np.left_shift(u, 1, out=r)
    np.right_shift(u, 8 * width - 1, out=t)
    np.bitwise_or(r, t, out=r)
    return r


def split(data: memoryview | bytes, width: int, rotate: bool = True) -> list[np.ndarray]:
    """The byte planes of the first ``len(data) // width`` elements, rotated unless ``rotate`` is False (plane j =
    byte j of each element). The planes live in this thread's scratch memory until its next call."""
    m, dt = len(data) // width, f"<u{width}"
    r, t = _scratch("r", m, dt), _scratch("t", m, dt)
    if rotate:
        _rotated(data, width, r, t)
    else:
        r = np.frombuffer(data, dtype=dt, count=m)  # read as it is: no copy
    planes = []
    for j in range(width):
        p = _scratch(f"p{j}", m, "u1")
        if j:
            np.right_shift(r, 8 * j, out=t)
            np.copyto(p, t, casting="unsafe")
        else:
            np.copyto(p, r, casting="unsafe")
        planes.append(p)
    return planes


def plane_stats(data: memoryview | bytes, width: int, rotate: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """For each rotated byte plane of ``data`` (a small sample): its order-0 entropy in bytes (what a Huffman coder
    gets close to) and the share of its bytes that nibbles would code without an escape. One histogram for all
    planes (plane j's bytes counted at j*256 + value)."""
    m, dt = len(data) // width, f"<u{width}"
    if m == 0:
        return np.zeros(width), np.ones(width)
    r = _rotated(data, width, np.empty(m, dt), np.empty(m, dt), rotate).view(np.uint8).reshape(m, width)
    counts = np.bincount((r + np.arange(0, 256 * width, 256, dtype=np.uint16)).ravel(),
                         minlength=256 * width).reshape(width, 256)
    c = counts.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = np.where(c > 0, c * np.log2(m / c), 0.0)
    return bits.sum(axis=1) / 8, np.array([best_base(row)[1] for row in counts])


def encode(data: memoryview | bytes, width: int, codings: list[int], zstd: zstandard.ZstdCompressor,
           rotate: bool = True) -> bytes:
    """The bytegroup blob of ``data``: plane j stored with ``codings[j]`` (planes.RAW, ZSTD, DEFLATE or NIBBLES),
    each falling back to RAW where coding would not shrink it; transform 1 (rotate), or 0 with ``rotate`` False."""
    if width not in WIDTHS or len(codings) != width:
        raise ValueError(f"bytegroup width {width} with {len(codings)} codings")
    m = len(data) // width
    records, parts = [], []
    for plane, coding in zip(split(data, width, rotate), codings):
        coding, stored = encode_plane(plane, coding, zstd)
        records.append(_PLANE.pack(coding, len(stored)))
        parts.append(stored)
    tail = bytes(data[m * width:])
    return b"".join([_HEAD.pack(VERSION, width, ROTATE if rotate else 0, 0), *records, *parts, tail])


def _bad(where: str, what: str) -> CorruptPackError:
    return CorruptPackError(f"corrupt bytegroup blob: {where}: {what}")


def decode(data: bytes | memoryview, size: int, where: str, out: memoryview | None = None) -> memoryview:
    """The ``size`` raw bytes of a bytegroup blob; CorruptPackError naming ``where`` on any inconsistency. With
    ``out`` (``size`` writable bytes) they are decoded straight into it (no fresh memory to fault in, no copy), and
    on damage it holds partial bytes, as a raw read would."""
    mv = memoryview(data).cast("B")
    if len(mv) < _HEAD.size:
        raise _bad(where, f"{len(mv)} bytes, shorter than its header")
    version, width, transform, reserved = _HEAD.unpack_from(mv)
    if version != VERSION or width not in WIDTHS or transform not in (0, ROTATE) or reserved:
        raise _bad(where, f"unknown layout (version {version}, width {width}, transform {transform})")
    m, tail = divmod(size, width)
    pos = header_size(width)
    if len(mv) < pos:
        raise _bad(where, f"{len(mv)} bytes, shorter than its header")
    records = [_PLANE.unpack_from(mv, _HEAD.size + j * _PLANE.size) for j in range(width)]
    for j, (coding, length) in enumerate(records):
        if coding not in CODINGS or (length != m if coding == RAW else not 0 < length < m):
            raise _bad(where, f"plane {j} has coding {coding} and length {length} (a plane is {m} bytes)")
    total = pos + sum(length for _c, length in records) + tail
    if total != len(mv):
        raise _bad(where, f"{len(mv)} bytes, but its header and raw size ({size}) call for {total}")
    dest = np.empty(size, np.uint8) if out is None else np.frombuffer(out, np.uint8)
    if len(dest) != size:
        raise ValueError(f"bytegroup.decode: out holds {len(dest)} bytes, not {size}")
    decoded = []
    for j, (coding, length) in enumerate(records):
        try:
            decoded.append(np.frombuffer(decode_plane(coding, mv[pos : pos + length], m), np.uint8))
        except PlaneError as exc:
            raise _bad(where, f"plane {j}: {exc}") from None
        pos += length
    _interleave(dest[: m * width], decoded, width)
    dest[m * width:] = np.frombuffer(mv[pos:], np.uint8)
    if transform == ROTATE and m:
        u = dest[: m * width].view(f"<u{width}")
        t = np.left_shift(u, 8 * width - 1)
        np.right_shift(u, 1, out=u)
        np.bitwise_or(u, t, out=u)
    return memoryview(dest)


def _interleave(body: np.ndarray, decoded: list[np.ndarray], width: int) -> None:
    """Byte j of each element of ``body`` from plane j. Shifting whole elements (top plane first) beats strided byte
    copies up to 4-byte elements: 4 MiB of bf16 0.31 vs 1.05 ms here, fp32 0.73 vs 1.09, fp64 1.62 vs 1.10."""
    if not len(body):
        return
    if width > 4:
        elems = body.reshape(-1, width)
        for j, plane in enumerate(decoded):
            np.copyto(elems[:, j], plane)
        return
    u = body.view(f"<u{width}")
    np.copyto(u, decoded[-1])
    for plane in decoded[-2::-1]:
        np.left_shift(u, 8, out=u)
        np.bitwise_or(u, plane, out=u)

"""The index sections of live-sync delta layers (docs/format.md §19.1): which elements of a tensor a layer carries,
as LEB128 varint gaps, fixed uint16 gaps, or a bitmap — vectorised with NumPy, decoders strict (ValueError)."""

from __future__ import annotations

import numpy as np

MAX_VARINT = 8  # bytes: 56 bits, beyond any element count (shape_fits bounds a tensor to 2**48 elements)



def _gaps(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gaps, varint length of each) of ascending flat indices."""
    gaps = np.diff(idx, prepend=0).astype(np.uint64 if idx.size and int(idx[-1]) >= 1 << 32 else np.uint32)
    nbytes = np.ones(gaps.shape, np.uint8)
    top = int(gaps.max()) if gaps.size else 0
    for k in range(1, MAX_VARINT):
        if top < 1 << (7 * k):
            break
        nbytes += gaps >= (1 << (7 * k))
    return gaps, nbytes


def encode_gaps(idx: np.ndarray, pre: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """LEB128 varints of the gaps of ascending flat indices (the first from 0), as uint8."""
    if not idx.size:
        return np.zeros(0, np.uint8)
    gaps, nbytes = pre if pre is not None else _gaps(idx)
    m = int(nbytes.max())
    if m == 1:
        return gaps.astype(np.uint8)
    pos = np.cumsum(nbytes, dtype=np.int64)
    out = np.empty(int(pos[-1]), np.uint8)
    pos -= nbytes
    out[pos] = (gaps & 0x7F).astype(np.uint8) | ((nbytes > 1).view(np.uint8) << 7)
    for k in range(1, m):  # the longer varints only: few at the densities element deltas are chosen for
        sel = np.flatnonzero(nbytes > k)
        nb = nbytes[sel]
        out[pos[sel] + k] = ((gaps[sel] >> (7 * k)) & 0x7F).astype(np.uint8) | ((nb > k + 1).view(np.uint8) << 7)
    return out


def gaps_size(idx: np.ndarray) -> int:
    """The length of ``encode_gaps(idx)`` without building it."""
    return int(_gaps(idx)[1].sum(dtype=np.int64)) if idx.size else 0


def decode_gaps(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The ascending flat indices coded in ``data`` (uint8); ValueError for anything but exactly ``count`` canonical
    varints of strictly ascending indices below ``numel``."""
    if count == 0:
        if data.size:
            raise ValueError("an index section of bytes for no element")
        return np.zeros(0, np.int64)
    if not data.size or data[-1] & 0x80:
        raise ValueError("the index section ends inside a varint")
    ends = np.flatnonzero(data < 0x80)
    if ends.size != count:
        raise ValueError(f"the index section holds {ends.size} varints, not {count}")
    lengths = np.diff(ends, prepend=-1)
    if int(lengths.max()) > MAX_VARINT:
        raise ValueError(f"a varint is longer than {MAX_VARINT} bytes")
    multi = lengths > 1
    if multi.any() and not data[ends[multi]].all():
        raise ValueError("a varint is not in its shortest form")
    starts = ends - lengths + 1
    gaps = (data[starts] & 0x7F).astype(np.uint64)
    for k in range(1, int(lengths.max())):  # the longer varints only, a byte position at a time
        sel = np.flatnonzero(lengths > k)
        gaps[sel] |= (data[starts[sel] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    if int(gaps.max()) >= numel:
        raise ValueError(f"a gap is beyond the tensor's {numel} elements")
    idx = np.cumsum(gaps.astype(np.int64))  # each gap < numel <= 2**48: no overflow below 2**15 gaps of 2**48
    if idx.size > 1 and not (idx[1:] > idx[:-1]).all():
        raise ValueError("the indices are not strictly ascending")
    if int(idx[-1]) >= numel or int(idx[0]) < 0:
        raise ValueError(f"an index is beyond the tensor's {numel} elements")
    return idx


def decode_gaps16(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    """The ascending flat indices coded as ``count`` little-endian uint16 gaps (the first from 0); ValueError unless
    strictly ascending and below ``numel``."""
    if data.size != 2 * count or not count:
        raise ValueError(f"a gaps16 section of {data.size} bytes for {count} elements")
    gaps = data.view("<u2")
    if count > 1 and not gaps[1:].all():
        raise ValueError("the indices are not strictly ascending")
    idx = np.cumsum(gaps, dtype=np.int64)
    if int(idx[-1]) >= numel:
        raise ValueError(f"an index is beyond the tensor's {numel} elements")
    return idx


def encode_bitmap(idx: np.ndarray, numel: int) -> np.ndarray:
    bits = np.zeros(numel, np.bool_)
    bits[idx] = True
    return np.packbits(bits, bitorder="little")


def decode_bitmap(data: np.ndarray, count: int, numel: int) -> np.ndarray:
    if data.size != (numel + 7) // 8:
        raise ValueError(f"a bitmap of {data.size} bytes for {numel} elements")
    bits = np.unpackbits(data, bitorder="little")
    if bits[numel:].any():
        raise ValueError("the bitmap sets bits beyond the tensor's elements")
    idx = np.flatnonzero(bits[:numel])
    if idx.size != count:
        raise ValueError(f"the bitmap sets {idx.size} bits, not {count}")
    return idx.astype(np.int64)

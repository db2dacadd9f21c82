"""Bounds on everything luopan reads (docs/format.md §11): file sizes and the integers inside files.

A file read whole is refused before it is read when it is larger than any valid file of its kind; every integer a
file declares is bounded before it sizes an allocation or reaches a system call, so a damaged or hostile repository
gets a typed error instead of an OverflowError, a MemoryError or a hang. Writers refuse to produce a file over its
limit, so everything luopan writes it can read back.
"""

from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Whole-file reads. Manifests grow ~180 bytes per chunk: 1 GiB holds ~5.9M chunks, 24 TB of state in 4 MiB chunks.
MAX_MANIFEST_BYTES = 1 * GiB
MAX_INDEX_BYTES = 1 * GiB  # one row per chunk; gc consolidates into one file
MAX_CONFIG_BYTES = 64 * KiB
MAX_SMALL_BYTES = 1 * MiB  # refs, pins, lock records, tier markers and settings
MAX_RECORD_BYTES = 64 * MiB  # run records: a git diff is cut at 16 MiB (runrecord.MAX_DIFF_BYTES)
MAX_EVAL_BYTES = 256 * MiB  # eval logs with per-sample outputs
MAX_CONDEMNED_BYTES = 256 * MiB  # gc/condemned.json: ~90 bytes per pack
MAX_TRAILER_BYTES = 256 * MiB  # a pack's trailer index: ~150 bytes per blob

# Integers inside files. 2^48 bytes = 256 TiB: far beyond any pack, chunk offset or tensor dimension luopan writes,
# and far below where a sum or product of a few of them could overflow a C integer.
MAX_OFFSET = 1 << 48
MAX_DIM = 1 << 48
MAX_NDIM = 64  # NumPy's limit; torch tensors with more dimensions are refused at save time
MAX_NBYTES = 1 << 62  # an entry's bytes (also the bound on the product of its non-zero dimensions × item size)
MAX_COUNT = 1 << 40  # counts and sizes in stats
MAX_PACK_SIZE = 4 * GiB  # repository config: pack_size
MAX_PATH_CHARS = 65536  # an entry's key path (manifest.schema.json: maxLength)


def shape_fits(shape: list[int] | tuple[int, ...], itemsize: int) -> bool:
    """Whether NumPy and torch can describe an array of this shape, and the manifest schema accept it: at most
    MAX_NDIM dimensions, each at most MAX_DIM, and the product of its non-zero dimensions times the item size within
    MAX_NBYTES (NumPy refuses (0, 2**62) even though it is empty)."""
    if len(shape) > MAX_NDIM:
        return False
    total = itemsize
    for d in shape:
        if d > MAX_DIM:
            return False
        total *= max(d, 1)
        if total > MAX_NBYTES:
            return False
    return True

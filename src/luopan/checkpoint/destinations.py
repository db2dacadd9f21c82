"""The memory a load reads fresh tensors and arrays into: arenas of huge pages, one per run of entries, so that the
reads fill memory that faults in 2 MiB at a time (no scratch buffer, no per-tensor allocation to fault page by
page).

Measured (1 GiB of 4 MiB fp32 tensors, warm page cache, 2 cores): reading into one torch.empty per tensor spent
~0.4 s faulting 4 KiB pages (the glibc mmap of each tensor is not 2 MiB-aligned, and advice on it covers at most
half); into 2 MiB-aligned arenas with MADV_HUGEPAGE the reads and their faults took ~0.13 s.

Each tensor (``torch.frombuffer``) or array (``numpy.frombuffer``) has its own storage of exactly its bytes, so
``torch.save`` of one writes only it and tied-weight detection sees distinct tensors. An arena is freed when the
last tensor in it is: entries are grouped in manifest order into arenas of at most ARENA_BYTES, and an entry
larger than that gets an arena of its own, so keeping part of a loaded state keeps at most that much more. The
storages are not resizable (``Tensor.resize_`` to a larger size raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._memory import HUGE_PAGE, advise_huge_pages
from ..tree import itemsize, new_array

# Entries share arenas of up to this many bytes (the most memory a kept tensor can keep alive beside itself).
ARENA_BYTES = 64 << 20
ALIGN = 64  # each entry starts on a cache line (and on any element boundary)


def fresh_arrays(specs: Sequence[tuple[str, str, Sequence[int]]]) -> list[tuple[Any, memoryview]]:
    """Uninitialised arrays/tensors for the ``(kind, dtype, shape)`` of each entry, with a writable flat byte view of
    each one's memory (as ``luopan.tree.new_array``, but laid out in huge-page arenas)."""
    out: list[Any] = [None] * len(specs)
    group: list[tuple[int, int]] = []  # (spec index, bytes) waiting for the arena they share
    used = 0

    def flush() -> None:
        nonlocal used
        if group:
            arena = _arena(used)
            pos = 0
            for k, n in group:
                out[k] = _wrap(specs[k], arena[pos : pos + n])
                pos += -(-n // ALIGN) * ALIGN
            group.clear()
        used = 0

    for k, (kind, dtype, shape) in enumerate(specs):
        n = _nbytes(kind, dtype, shape)
        if not n or (kind == "torch" and _torch() is None):
            out[k] = new_array(kind, dtype, list(shape))  # empty, or an unknown dtype/no torch: its errors
            continue
        if used + n > ARENA_BYTES:
            flush()
        group.append((k, n))
        used += -(-n // ALIGN) * ALIGN
    flush()
    return out


def _nbytes(kind: str, dtype: str, shape: Sequence[int]) -> int:
    size = itemsize(kind, dtype)
    if size is None:
        return 0
    n = size
    for d in shape:
        n *= int(d)
    return n


def _arena(nbytes: int) -> memoryview:
    """``nbytes`` of fresh memory starting on a huge page, the huge pages it spans asked for. The over-allocation
    around it is never touched (not resident)."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = np.empty(span + HUGE_PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    advise_huge_pages(raw.ctypes.data + start, span)
    return memoryview(raw[start : start + nbytes])


def _wrap(spec: tuple[str, str, Sequence[int]], view: memoryview) -> tuple[Any, memoryview]:
    kind, dtype, shape = spec
    if kind == "torch":
        torch = _torch()
        flat = torch.frombuffer(view, dtype=torch.uint8)  # its own storage, of exactly these bytes
        return flat.view(getattr(torch, dtype)).reshape(list(shape)), view  # dtype checked by _nbytes (itemsize)
    return np.frombuffer(view, dtype=np.dtype(dtype)).reshape(list(shape)), view


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch

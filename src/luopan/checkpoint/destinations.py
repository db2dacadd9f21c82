"""The memory a load reads fresh tensors and arrays into: arenas, each holding a run of entries, that the chunks are
read into and verified in (no scratch buffer, no copy), with huge pages asked for where they are large.

Each tensor (``torch.frombuffer``) or array (``numpy.frombuffer``) has its own storage of exactly its bytes, so
``torch.save`` of one writes only it and tied-weight detection sees distinct tensors. An arena is freed when the
last entry in it is: entries are grouped in manifest order into arenas of at most ARENA_BYTES, and an entry
larger than that gets one of its own, so keeping part of a loaded state keeps at most that much more alive. The
storages are not resizable (``Tensor.resize_`` to a larger size raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._memory import advise_huge_pages
from ..tree import itemsize, new_array

# Entries share arenas of up to this many bytes (the most memory a kept tensor can keep alive beside itself). Below
# glibc's largest mmap threshold (32 MiB), so a load's arenas can reuse memory an earlier load freed: fresh pages
# cost the most here (zeroed by the kernel, and in a VM often by the host too). Measured, 1 GiB of fp32 (308
# tensors) loaded repeatedly in one process on 2 busy cores, medians of 4 runs: 16 MiB arenas 0.40-0.80 s, a
# torch.empty per tensor 0.37-1.00 s (slower in 3 of 4), 64 MiB arenas mapped fresh on huge pages 0.71-1.44 s;
# safetensors load_file(pread) 0.65-1.11 s in the same processes.
ARENA_BYTES = 16 << 20
ALIGN = 64  # each entry starts on a cache line (and on any element boundary)


def fresh_arrays(specs: Sequence[tuple[str, str, Sequence[int]]]) -> list[tuple[Any, memoryview]]:
    """Uninitialised arrays/tensors for the ``(kind, dtype, shape)`` of each entry, with a writable flat byte view of
    each one's memory (as ``luopan.tree.new_array``, but cut from shared arenas)."""
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
    """``nbytes`` of uninitialised memory from the allocator, the huge pages inside it asked for."""
    raw = np.empty(nbytes, dtype=np.uint8)
    advise_huge_pages(raw.ctypes.data, nbytes)
    return memoryview(raw)


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

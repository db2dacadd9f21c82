"""Fixed, aligned chunk boundaries (docs/format.md §5)."""

from __future__ import annotations

from collections.abc import Sequence


def chunk_spans(nbytes: int, shape: Sequence[int], chunk_size: int) -> tuple[str, list[tuple[int, int]]]:
    """(chunking mode, [(offset, length), ...]) for an entry; a pure function of its shape and size."""
    if nbytes == 0:
        return "flat", []
    step = chunk_size
    mode = "flat"
    if len(shape) >= 2 and shape[0] > 0:
        row = nbytes // shape[0]
        if 0 < row <= chunk_size:
            step = (chunk_size // row) * row
            mode = "rows"
    return mode, [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

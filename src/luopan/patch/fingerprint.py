"""Content fingerprints of a set of tensors (docs/format.md §13.3): one hash over every tensor's name, dtype, shape
and bytes, the same whether the tensors come from a luopan checkpoint or from a plain safetensors file.

The bytes enter through the BLAKE3 addresses of the tensor's §5 chunks at a given chunk size: a checkpoint's manifest
already holds them (no byte is read to fingerprint a stored base), and a file is hashed once, chunk by chunk, which
is also what finds the chunks a patch need not carry. Fingerprints are comparable at equal chunk sizes; a patch
records the one both of its fingerprints use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import blake3

from ..format.canonical import canonical

FORMAT = "luopan-content-fingerprint"


def content_fingerprint(chunk_size: int, tensors: Iterable[tuple[str, str, Sequence[int], Sequence[str]]]) -> str:
    """``blake3:<hex>`` of ``(name, dtype, shape, chunk hashes)`` for every tensor, in name order (the order of a
    file's tensors does not matter; dtypes are luopan names such as ``float32``, ``bfloat16``)."""
    rows = sorted([name, dtype, list(shape), list(hashes)] for name, dtype, shape, hashes in tensors)
    doc = {"chunk_size": chunk_size, "format": FORMAT, "tensors": rows}
    return "blake3:" + blake3.blake3(canonical(doc)).hexdigest()

"""The tensors of a checkpoint (or of one subtree) as a patch sees them: named as ``luopan export`` names them, cut
into §5 chunks at the patch's chunk size. An entry stored in exactly those chunks gives its chunk hashes from the
manifest without a byte read; one stored otherwise (a row delta, another chunk size) is read, verified, and cut
again, so its chunk hashes are those of its real bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import blake3

from ..checkpoint import chunk_refs, delta_jobs, select_entries
from ..errors import UnsupportedValueError
from ..format.dtypes import SAFETENSORS_DTYPES
from ..format.manifest import Manifest, Row
from ..repository.chunkio import PackSizes, read_chunk, read_chunks
from ..store.base import Store
from .header import name_problem, spans


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    entry: int  # the entry holding the bytes (an alias's source)
    hashes: tuple[str, ...] | None  # chunk hashes at the patch's chunk size, when the manifest already has them


def export_metadata(m: Manifest) -> dict[str, str]:
    """The safetensors ``__metadata__`` that ``luopan export`` writes for this checkpoint."""
    return {"format": "pt", "luopan.run": m.run, "luopan.step": str(m.step), "luopan.fingerprint": m.doc["fingerprint"]}


def checkpoint_tensors(m: Manifest, subtree: str | None, chunk_size: int) -> list[StoredTensor]:
    """The tensors at or below ``subtree`` in export order. UnsupportedValueError for a dtype safetensors cannot
    hold or a name a patch may not carry; CheckpointNotFoundError when there are none."""
    out = []
    for name, i in select_entries(m, subtree):
        e = m.entries[i]
        source = e.get("alias_of", i)
        if e["dtype"] not in SAFETENSORS_DTYPES:
            raise UnsupportedValueError(f"entry {e['path']!r} has dtype {e['dtype']}, which safetensors (and so a "
                                        "patch) cannot hold; make the patch of a subtree without it (--subtree)")
        problem = name_problem(name)
        if problem is not None:
            raise UnsupportedValueError(f"entry {e['path']!r} cannot be named {name!r} in a patch: {problem}; "
                                        "choose another --subtree")
        shape = tuple(e["shape"])
        step, count = spans(e["nbytes"], shape, chunk_size)
        stored = m.entries[source]
        rows = [Row._make(r) for r in stored.get("chunks", [])]
        direct = "delta" not in stored and "xor" not in stored and len(rows) == count and all(
            r.size == min(step, e["nbytes"] - k * step) for k, r in enumerate(rows))
        out.append(StoredTensor(name, e["dtype"], shape, e["nbytes"], source,
                                tuple(r.hash for r in rows) if direct else None))
    return out


def tensor_chunks(store: Store, m: Manifest, t: StoredTensor, chunk_size: int, sizes: PackSizes,
                  need: Callable[[str], bool]) -> Iterator[tuple[str, int, bytes | bytearray | None]]:
    """(hash, size, bytes) of each chunk of ``t`` at ``chunk_size``, in order; the bytes (read and verified) only
    where ``need(hash)`` says so, else None."""
    if t.hashes is not None:
        for (_pos, ref), h in zip(chunk_refs(m, t.entry), t.hashes, strict=True):
            if need(h):
                sizes.check(ref)
                buf = bytearray(ref.size)
                read_chunk(store, ref, memoryview(buf), sizes)
                yield h, ref.size, buf
            else:
                yield h, ref.size, None
        return
    for piece in _recut(store, m, t, chunk_size, sizes):
        h = blake3.blake3(piece).hexdigest()
        yield h, len(piece), piece if need(h) else None


def _recut(store: Store, m: Manifest, t: StoredTensor, chunk_size: int, sizes: PackSizes) -> Iterator[bytearray]:
    """The entry's real bytes (row delta applied), cut at ``chunk_size``: one stored chunk and one new chunk in
    memory at a time."""
    delta, jobs = delta_jobs(m, t.entry, store, sizes)
    if delta is not None:
        read_chunks(store, jobs, sizes=sizes)
        delta.decode()
    step, _count = spans(t.nbytes, t.shape, chunk_size)
    done = 0
    cur = bytearray()
    for pos, ref in chunk_refs(m, t.entry):
        sizes.check(ref)
        buf = bytearray(ref.size)
        read_chunk(store, ref, memoryview(buf), sizes)
        if delta is not None:
            delta.apply(memoryview(buf), pos)
        view = memoryview(buf)
        i = 0
        while i < len(view):
            want = min(step, t.nbytes - done) - len(cur)
            cur += view[i : i + want]
            i += want
            if len(cur) == min(step, t.nbytes - done):
                done += len(cur)
                yield cur
                cur = bytearray()

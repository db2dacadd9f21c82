"""Verification of manifests of any kind: every distinct chunk read once and checked against its BLAKE3, each pack's
trailer checked, index files parsed (docs/format.md §10 rule 7)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    IntegrityError,
    LuopanError,
    StorageError,
    UnreadableError,
    UnsupportedFormatError,
)
from ..format.index import parse_index
from ..format.limits import MAX_INDEX_BYTES
from ..format.manifest import Row, patch_segments
from ..format.names import is_index_key
from ..store.base import KeyNotFound, Store
from .chunkio import ChunkRef, check_pack_trailer, read_chunk, verify_chunks
from .kinds import Kind


@dataclass
class Checked:
    """What a verification read: manifests, distinct chunks and their bytes, and every problem found."""

    manifests: int = 0
    chunks: int = 0
    bytes: int = 0
    problems: list[LuopanError] = field(default_factory=list)
    chunk_problems: list[LuopanError] = field(default_factory=list)


def as_problem(exc: Exception) -> LuopanError:
    """A verify problem: integrity errors as they are, an unreadable file as UnreadableError."""
    if isinstance(exc, StorageError) or not isinstance(exc, LuopanError):
        return UnreadableError(str(exc))
    return exc


def manifest_chunk_refs(kind: Kind, series: str, number: int, doc: dict[str, Any]) -> Iterator[ChunkRef]:
    """Every chunk a manifest document needs: each entry's chunks, a row delta's index and values, an XOR delta's
    chunks, and its entry groups' blobs."""
    owner = kind.label(series, number)
    packs = doc["packs"]
    for e in doc["entries"]:
        parts = [(e["path"], e.get("chunks", []))]
        if "delta" in e:
            parts += [(f"{e['path']} (row delta {p})", e["delta"][p]) for p in ("index", "values")]
        if "xor" in e:
            parts.append((f"{e['path']} (XOR delta)", e["xor"]["chunks"]))
        for path, rows in parts:
            for n, r in enumerate(map(Row._make, rows)):
                yield ChunkRef(owner, path, n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)
    for n, r in enumerate(map(Row._make, doc.get("groups", []))):  # a grouped manifest's entry groups (§8.5)
        yield ChunkRef(owner, "(entry groups)", n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)


def verify_manifests(store: Store, read: Callable[[Kind, str, int], dict[str, Any]],
                     targets: list[tuple[Kind, str, int]], *, progress: Callable[[int], Any] | None = None,
                     on_total: Callable[[int], Any] | None = None) -> Checked:
    """Read and check every chunk the ``targets`` need (each distinct chunk once); problems are collected."""
    out = Checked(manifests=len(targets))
    refs: dict[str, ChunkRef] = {}
    deltas: list[tuple[str, list[str], dict[str, Any]]] = []  # (owner, packs, entry) of each row delta
    for kind, series, number in targets:
        try:
            doc = read(kind, series, number)
        except KeyNotFound:
            continue
        except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
            out.problems.append(as_problem(exc))
            continue
        try:
            for ref in manifest_chunk_refs(kind, series, number, doc):
                refs.setdefault(f"{ref.hash}/{ref.pack}/{ref.offset}", ref)
        except (IndexError, KeyError, TypeError, ValueError) as exc:  # a kind's parser let a bad row through
            out.problems.append(IntegrityError(f"{kind.label(series, number)}: a chunk row is damaged ({exc})"))
            continue
        deltas += [(kind.label(series, number), doc["packs"], e) for e in doc["entries"] if "delta" in e]
    out.chunks = len(refs)
    out.bytes = sum(r.size for r in refs.values())
    if on_total is not None:
        on_total(out.bytes)
    for pack in sorted({r.pack for r in refs.values()}):
        trailer_problem = check_pack_trailer(store, pack)
        if trailer_problem is not None:
            out.problems.append(trailer_problem)
    out.chunk_problems = list(verify_chunks(store, list(refs.values()), progress))
    out.problems += out.chunk_problems
    out.problems += patch_problems(store, deltas)
    return out


def patch_problems(store: Store, deltas: list[tuple[str, list[str], dict[str, Any]]]) -> list[LuopanError]:
    """What a load checks of a row delta's patch beyond its chunks' hashes (format.manifest.patch_segments, the
    check the load runs), for each (owner, its manifest's packs, entry with a delta): its index chunks are read again
    (8 bytes a changed row). A chunk that cannot be read is left to the chunk problems, which name it already."""
    found: list[LuopanError] = []
    for owner, packs, e in deltas:
        rows = [Row._make(r) for r in e["delta"]["index"]]
        data = bytearray(sum(r.size for r in rows))
        pos = 0
        try:
            for n, r in enumerate(rows):
                ref = ChunkRef(owner, f"{e['path']} (row delta index)", n, r.hash, packs[r.pack], r.offset,
                               r.length, r.size, r.codec)
                read_chunk(store, ref, memoryview(data)[pos : pos + r.size])
                pos += r.size
        except (IntegrityError, StorageError, KeyNotFound):
            continue
        try:
            patch_segments(e, data, owner)
        except IntegrityError as exc:
            found.append(exc)
    return found


def index_problems(store: Store) -> list[LuopanError]:
    """Damaged or unreadable index files (they steer deduplication)."""
    found: list[LuopanError] = []
    for key in store.list("index/"):
        if not is_index_key(key):
            continue
        try:
            parse_index(store.get_limited(key, MAX_INDEX_BYTES), key)
        except KeyNotFound:
            continue
        except (IntegrityError, StorageError) as exc:
            found.append(as_problem(exc))
    return found


def raise_problems(problems: list[LuopanError], report: Any) -> None:
    """IntegrityError listing (up to 20 of) ``problems``, with ``.problems`` and ``.report``; nothing if none."""
    if not problems:
        return
    shown = "\n  ".join(str(p) for p in problems[:20])
    more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
    err = IntegrityError(f"{len(problems)} problem(s) found:\n  {shown}{more}")
    err.problems = problems
    err.report = report
    raise err

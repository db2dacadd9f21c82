"""Index snapshot manifests and the current ref: build, seal, parse and validate (docs/format.md §§17.2, 17.4).

A snapshot lists each array of the decomposed index (the skeleton included) as an entry with its dtype, shape and
chunk rows (docs/format.md §8); parsing checks everything a load relies on, so a damaged or hostile manifest is a
CorruptManifestError, never a KeyError or a buffer sized by a lie.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import CorruptManifestError, CorruptRepoError
from ..format import ROWMAP_FORMAT_VERSION
from ..format.canonical import seal, unseal_file
from ..format.limits import MAX_COUNT, MAX_NBYTES, shape_fits
from ..format.kindmanifest import check_created, check_members, chunk_row_ok, is_uint, open_manifest
from ..format.manifest import chunk_bytes
from ..format.names import MAX_STEP, is_hex64
from .names import is_index_name

INDEX_FORMAT_VERSION = 4  # docs/format.md §1: index snapshots arrived with format 4
LAYOUTS = ("parts", "serialized")
DTYPES = ("uint8", "int32", "int64", "uint64")
SKELETON = "skeleton"
IDS = "ids"
MAX_ENTRIES = 1 << 22
MAX_PATH_CHARS = 256
MAX_FIELD = 1 << 40
_TOP = {"format_version": int, "kind": str, "name": str, "version": int, "created": str, "layout": str,
        "index_type": str, "dim": int, "ntotal": int, "fields": dict, "params": dict, "metadata": dict,
        "packs": list, "entries": list, "stats": dict}
_STATS = ("logical_bytes", "stored_bytes", "new_bytes", "chunks", "new_chunks", "new_packs")


def _row_ok(row: object) -> bool:
    return chunk_row_ok(row, 1 << 48)


def _path_ok(path: object) -> bool:
    return (isinstance(path, str) and 0 < len(path) <= MAX_PATH_CHARS and path.isascii()
            and all(p and p not in (".", "..") and p.replace("_", "").replace(".", "").isalnum()
                    for p in path.split("/")))


def seal_index_manifest(doc: dict[str, Any]) -> bytes:
    return seal(doc)


def entry_nbytes(entry: dict[str, Any]) -> int:
    return math.prod(entry["shape"]) * np.dtype(entry["dtype"]).itemsize


def parse_index_manifest(data: bytes, where: str, name: str | None = None,
                         version: int | None = None) -> dict[str, Any]:
    """Parse and fully validate an index snapshot manifest read from ``where``; CorruptManifestError names what is
    wrong."""

    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"index manifest {where}: {msg}")

    doc = open_manifest(data, where, "index manifest")
    check_members(doc, _TOP, bad)
    if doc["kind"] != "index" or doc["layout"] not in LAYOUTS or not 1 <= doc["format_version"]:
        raise bad("it is not an index snapshot (kind/layout)")
    if not is_index_name(doc["name"]) or not 1 <= doc["version"] <= MAX_STEP:
        raise bad("its name or version is invalid")
    if name is not None and (doc["name"], doc["version"]) != (name, version):
        raise bad(f"it names {doc['name']!r} version {doc['version']}, not its location's {name!r} version {version}")
    check_created(doc, bad)
    if not (0 < len(doc["index_type"]) <= 200 and doc["index_type"].isascii()):
        raise bad("its index_type is invalid")
    if not is_uint(doc["dim"], 1 << 31) or not is_uint(doc["ntotal"], MAX_COUNT):
        raise bad("its dim or ntotal is out of range")
    if not all(isinstance(k, str) and len(k) <= MAX_PATH_CHARS and isinstance(v, int) and not isinstance(v, bool)
               and -MAX_FIELD <= v < MAX_FIELD for k, v in doc["fields"].items()):
        raise bad("its fields are invalid")
    stats = doc["stats"]
    if not all(is_uint(stats.get(k)) for k in _STATS):
        raise bad("its stats are incomplete")
    packs = doc["packs"]
    if not all(is_hex64(p) for p in packs) or len(set(packs)) != len(packs):
        raise bad("a pack id is invalid or repeated")
    entries = doc["entries"]
    if len(entries) > MAX_ENTRIES:
        raise bad("it has too many entries")
    seen: set[str] = set()
    total = 0
    for e in entries:
        if not isinstance(e, dict) or set(e) != {"path", "dtype", "shape", "chunking", "chunks"}:
            raise bad("an entry does not have exactly path, dtype, shape, chunking and chunks")
        path = e["path"]
        if not _path_ok(path) or path in seen:
            raise bad(f"entry path {str(path)[:80]!r} is invalid or repeated")
        seen.add(path)
        shape = e["shape"]
        if (e["dtype"] not in DTYPES or not isinstance(shape, list) or not 1 <= len(shape) <= 2
                or not all(is_uint(d, 1 << 48) for d in shape) or not shape_fits(shape, np.dtype(e["dtype"]).itemsize)):
            raise bad(f"entry {path!r} has an invalid dtype or shape")
        if e["chunking"] != "extent" or not isinstance(e["chunks"], list) or not all(map(_row_ok, e["chunks"])):
            raise bad(f"entry {path!r} has a malformed chunk row or chunking")
        held = chunk_bytes(e["chunks"], len(packs), path, bad)
        nbytes = entry_nbytes(e)
        if held != nbytes:
            raise bad(f"entry {path!r} chunks hold {held} bytes, its {e['dtype']} {shape} is {nbytes}")
        total += nbytes
    _check_rowmaps(doc, {e["path"]: e for e in entries}, bad)
    need = {SKELETON} if doc["layout"] == "parts" else {"serialized"}
    if not need <= seen:
        raise bad(f"it lacks the entry {min(need - seen)!r}")
    if stats["logical_bytes"] != total or total > MAX_NBYTES:
        raise bad(f"its stats say {stats['logical_bytes']} logical bytes, its entries hold {total}")
    return doc


def _check_rowmaps(doc: dict[str, Any], entries: dict[str, dict[str, Any]], bad: Any) -> None:
    """The optional ``rowmaps`` (§17.7): each names its columns (pool entries with equal row counts), its runs entry
    (int64 [R, 2]), its live row count and the XXH3-128 of its live bytes; no entry serves two roles."""
    if "rowmaps" not in doc:
        return
    rowmaps = doc["rowmaps"]
    if doc["format_version"] < ROWMAP_FORMAT_VERSION or doc["layout"] != "parts" or not isinstance(rowmaps, list) \
            or len(rowmaps) > 64:
        raise bad("its rowmaps member is invalid for its format_version or layout")
    used: set[str] = {SKELETON}
    for rm in rowmaps:
        if not isinstance(rm, dict) or set(rm) != {"columns", "runs", "rows", "xxh3"}:
            raise bad("a row map does not have exactly columns, runs, rows and xxh3")
        cols, runs = rm["columns"], rm["runs"]
        if not isinstance(cols, list) or not 1 <= len(cols) <= 4 or not is_uint(rm["rows"], MAX_COUNT) or \
                not (isinstance(rm["xxh3"], str) and len(rm["xxh3"]) == 32 and
                     all(c in "0123456789abcdef" for c in rm["xxh3"])):
            raise bad("a row map's columns, rows or xxh3 are invalid")
        names = [*cols, runs]
        if not all(isinstance(p, str) and p in entries for p in names) or len(set(names)) != len(names) or \
                used & set(names):
            raise bad("a row map names a missing entry, or an entry another role already has")
        used |= set(names)
        r = entries[runs]
        if r["dtype"] != "int64" or len(r["shape"]) != 2 or r["shape"][1] != 2:
            raise bad(f"row map runs {runs!r} are not int64 [runs, 2]")
        pool = {entries[c]["shape"][0] for c in cols}
        if len(pool) != 1:
            raise bad(f"the columns {cols} of a row map have different pool row counts")
        for c in cols:
            live = [rm["rows"], *entries[c]["shape"][1:]]
            if not shape_fits(live, np.dtype(entries[c]["dtype"]).itemsize):
                raise bad(f"row map column {c!r} would be too large")


# -- the current ref: refs/indexes/<name>/current.json ---------------------------------------------------------------
def build_current(name: str, version: int, log_start: int) -> bytes:
    return seal({"format_version": INDEX_FORMAT_VERSION, "name": name, "version": version, "log_start": log_start})


def parse_current(data: bytes, where: str, name: str) -> dict[str, Any]:
    """The live version a current ref names, checked; CorruptRepoError naming the file on damage."""
    doc = unseal_file(data, f"index ref {where}")
    version, log_start = doc.get("version"), doc.get("log_start")
    if doc.get("name") != name or not is_uint(version, MAX_STEP + 1) or version < 1 or not is_uint(log_start):
        raise CorruptRepoError(f"index ref {where} is damaged: it does not name index {name!r} and a version; "
                               f"repair it with `luopan index rollback {name} VERSION`")
    return doc

"""Artifact version manifests: build, seal, parse and validate (docs/format.md §8.2).

A version lists every file and directory of what was committed with its relative path and mode; a file's bytes are
content-defined chunks (FastCDC), each a chunk row of docs/format.md §8 in the repository's packs.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import CorruptManifestError
from ..format.canonical import seal
from ..format.kindmanifest import check_created, check_members, chunk_row_ok, open_manifest
from ..format.manifest import chunk_bytes
from ..format.names import MAX_PATH_CHARS, is_artifact_name, parse_ref_text, path_problem, show_path
from ..errors import InvalidNameError, ManifestNameError

ARTIFACT_FORMAT_VERSION = 3  # docs/format.md §1: artifacts arrived with format 3
MAX_ENTRIES = 1_000_000
MAX_PARENTS = 1024
MODE_MASK = 0o7777
MAX_ARTIFACT_CHUNK = 16 << 20  # FastCDC's largest maximum: a row declaring more is damage (buffers sized by rows)
ROOTS = ("dir", "file", "files")  # what was committed: a directory, one file, a {path: bytes} mapping
_TOP = {"format_version": int, "kind": str, "name": str, "version": int, "created": str, "root": str,
        "parents": list, "metadata": dict, "packs": list, "entries": list, "stats": dict}
_STATS = ("logical_bytes", "files", "chunks", "new_chunks", "new_bytes", "stored_bytes")


def check_relpath(path: object) -> str | None:
    """Why ``path`` is not a relative path inside the artifact (None when it is one): the name rule of every kind
    (luopan.format.names.path_problem)."""
    return path_problem(path, MAX_PATH_CHARS)


def seal_artifact_manifest(doc: dict[str, Any]) -> bytes:
    return seal(doc)


def parse_artifact_manifest(data: bytes, where: str, name: str | None = None,
                            version: int | None = None) -> dict[str, Any]:
    """Parse and fully validate an artifact manifest read from ``where``; CorruptManifestError names what is wrong.
    A manifest whose only fault is a file name the name rule refuses (written by a luopan that did not check it) gives
    ManifestNameError, whose ``doc`` (valid in every other respect) says which chunks it references."""

    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"artifact manifest {where}: {msg}")

    doc = open_manifest(data, where, "artifact manifest")
    check_members(doc, _TOP, bad)
    if doc["kind"] != "artifact" or doc["root"] not in ROOTS:
        raise bad("it is not an artifact version (kind/root)")
    if not is_artifact_name(doc["name"]) or not 1 <= doc["version"] < 10**15:
        raise bad("its name or version is invalid")
    if name is not None and (doc["name"], doc["version"]) != (name, version):
        raise bad(f"it names {doc['name']!r} version {doc['version']}, not its location's {name!r} version {version}")
    check_created(doc, bad)
    if len(doc["parents"]) > MAX_PARENTS:
        raise bad("it names too many parents")
    for parent in doc["parents"]:
        try:
            parse_ref_text(parent, "parent")
        except InvalidNameError as exc:
            raise bad(str(exc)) from None
    stats = doc["stats"]
    if not all(isinstance(stats.get(k), int) and not isinstance(stats.get(k), bool) and stats[k] >= 0 for k in _STATS):
        raise bad("its stats are incomplete")
    packs = doc["packs"]
    if not all(isinstance(p, str) and len(p) == 64 for p in packs):
        raise bad("a pack id is invalid")
    entries = doc["entries"]
    if len(entries) > MAX_ENTRIES:
        raise bad("it has too many entries")
    seen: set[str] = set()
    misnamed: list[tuple[str, str]] = []  # (path, why): names the rule refuses, reported once the rest is checked
    total = 0
    for e in entries:
        if not isinstance(e, dict) or e.get("type") not in ("file", "dir"):
            raise bad("an entry is not a file or directory")
        path = e.get("path")
        if not isinstance(path, str):
            raise bad("an entry path is not a string")
        why = path_problem(path, MAX_PATH_CHARS)
        if why is not None:
            misnamed.append((path, why))
        if path in seen:
            raise bad(f"entry {show_path(path, 80)} appears twice")
        seen.add(path)
        mode = e.get("mode")
        if not isinstance(mode, int) or isinstance(mode, bool) or mode & ~MODE_MASK:
            raise bad(f"entry {show_path(path, 80)} has an invalid mode")
        if e["type"] == "dir":
            if "chunks" in e or "size" in e:
                raise bad(f"directory entry {show_path(path, 80)} has contents")
            continue
        size = e.get("size")
        chunks = e.get("chunks")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(chunks, list) \
                or e.get("chunking") != "cdc":
            raise bad(f"file entry {show_path(path, 80)} lacks its size, chunks or chunking")
        if not all(chunk_row_ok(r) for r in chunks):
            raise bad(f"file entry {show_path(path, 80)} has a malformed chunk row")
        if any(r[4] > MAX_ARTIFACT_CHUNK for r in chunks):
            raise bad(f"file entry {show_path(path, 80)} has a chunk larger than {MAX_ARTIFACT_CHUNK} bytes")
        held = chunk_bytes(chunks, len(packs), path, bad)
        if held != size:
            raise bad(f"file entry {show_path(path, 80)} chunks hold {held} bytes, expected {size}")
        total += size
    refused = {p for p, _why in misnamed}
    for path in seen - refused:  # every parent directory of an entry is an entry too (modes and empty dirs round-trip)
        parent = path.rpartition("/")[0]
        if parent and parent not in seen:
            raise bad(f"entry {show_path(path, 80)} has no entry for its directory {show_path(parent, 80)}")
    if stats["logical_bytes"] != total:
        raise bad(f"its stats say {stats['logical_bytes']} logical bytes, its files hold {total}")
    if not math.isfinite(float(total)):
        raise bad("impossible size")
    if misnamed:
        path, why = misnamed[0]
        more = f" (and {len(misnamed) - 1} more)" if len(misnamed) > 1 else ""
        exc = ManifestNameError(
            f"artifact manifest {where}: entry {show_path(path, 80)} is {why}{more}. luopan refuses such names "
            "(docs/format.md §2; an older luopan stored them): this version cannot be loaded, but what it "
            "references is known and gc keeps it. Commit the files again under names without control "
            "characters or backslashes, then delete this manifest file to let gc free what only it uses")
        exc.doc = doc
        raise exc
    return doc

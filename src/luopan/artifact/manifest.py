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
from ..format.names import is_artifact_name, parse_ref_text
from ..errors import InvalidNameError

ARTIFACT_FORMAT_VERSION = 3  # docs/format.md §1: artifacts arrived with format 3
MAX_ENTRIES = 1_000_000
MAX_PATH_CHARS = 4096
MAX_PARENTS = 1024
MODE_MASK = 0o7777
MAX_ARTIFACT_CHUNK = 16 << 20  # FastCDC's largest maximum: a row declaring more is damage (buffers sized by rows)
ROOTS = ("dir", "file", "files")  # what was committed: a directory, one file, a {path: bytes} mapping
_TOP = {"format_version": int, "kind": str, "name": str, "version": int, "created": str, "root": str,
        "parents": list, "metadata": dict, "packs": list, "entries": list, "stats": dict}
_STATS = ("logical_bytes", "files", "chunks", "new_chunks", "new_bytes", "stored_bytes")


def check_relpath(path: object) -> str | None:
    """Why ``path`` is not a relative path inside the artifact (None when it is one): '/'-separated, no empty, '.'
    or '..' part, no leading '/', no backslash, NUL or control character."""
    if not isinstance(path, str) or not path:
        return "an empty path"
    if len(path) > MAX_PATH_CHARS:
        return f"a path longer than {MAX_PATH_CHARS} characters"
    if path.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "a path with an empty, '.' or '..' part (it would escape or alias the directory)"
    if "\\" in path or any(ord(c) < 32 or c == "\x7f" for c in path):
        return "a path with a backslash or a control character"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in path):
        return "a path that is not valid Unicode (a lone surrogate)"
    return None


def seal_artifact_manifest(doc: dict[str, Any]) -> bytes:
    return seal(doc)


def parse_artifact_manifest(data: bytes, where: str, name: str | None = None,
                            version: int | None = None) -> dict[str, Any]:
    """Parse and fully validate an artifact manifest read from ``where``; CorruptManifestError names what is wrong."""

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
    total = 0
    for e in entries:
        if not isinstance(e, dict) or e.get("type") not in ("file", "dir"):
            raise bad("an entry is not a file or directory")
        path = e.get("path")
        why = check_relpath(path)
        if why is not None:
            raise bad(f"entry path {str(path)[:80]!r} is {why}")
        if path in seen:
            raise bad(f"entry {path!r} appears twice")
        seen.add(path)
        mode = e.get("mode")
        if not isinstance(mode, int) or isinstance(mode, bool) or mode & ~MODE_MASK:
            raise bad(f"entry {path!r} has an invalid mode")
        if e["type"] == "dir":
            if "chunks" in e or "size" in e:
                raise bad(f"directory entry {path!r} has contents")
            continue
        size = e.get("size")
        chunks = e.get("chunks")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(chunks, list) \
                or e.get("chunking") != "cdc":
            raise bad(f"file entry {path!r} lacks its size, chunks or chunking")
        if not all(chunk_row_ok(r) for r in chunks):
            raise bad(f"file entry {path!r} has a malformed chunk row")
        if any(r[4] > MAX_ARTIFACT_CHUNK for r in chunks):
            raise bad(f"file entry {path!r} has a chunk larger than {MAX_ARTIFACT_CHUNK} bytes")
        held = chunk_bytes(chunks, len(packs), path, bad)
        if held != size:
            raise bad(f"file entry {path!r} chunks hold {held} bytes, expected {size}")
        total += size
    for path in seen:  # every parent directory of an entry is an entry too (so modes and empty dirs round-trip)
        parent = path.rpartition("/")[0]
        if parent and parent not in seen:
            raise bad(f"entry {path!r} has no entry for its directory {parent!r}")
    if stats["logical_bytes"] != total:
        raise bad(f"its stats say {stats['logical_bytes']} logical bytes, its files hold {total}")
    if not math.isfinite(float(total)):
        raise bad("impossible size")
    return doc

"""Journal snapshot manifests: build, seal, parse and validate (docs/format.md §16.3)."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptManifestError
from ..format.canonical import seal
from ..format.kindmanifest import check_created, check_members, chunk_row_ok, is_uint, open_manifest
from ..format.manifest import chunk_bytes
from .names import is_journal_name

JOURNAL_FORMAT_VERSION = 4  # docs/format.md §1: journals and index snapshots arrived with format 4
VALUE_TYPES = ("bytes", "json")
MAX_SNAPSHOT_CHUNK = 1 << 20  # the content-defined chunker's maximum: a row declaring more is damage
_TOP = {"format_version": int, "kind": str, "name": str, "seq": int, "created": str, "metadata": dict,
        "packs": list, "entries": list, "stats": dict}
_STATS = ("logical_bytes", "chunks", "new_chunks", "new_bytes", "stored_bytes", "new_packs", "records")


def seal_snapshot_manifest(doc: dict[str, Any]) -> bytes:
    return seal(doc)


def parse_snapshot_manifest(data: bytes, where: str, name: str | None = None, seq: int | None = None
                            ) -> dict[str, Any]:
    """Parse and fully validate a journal snapshot manifest; CorruptManifestError names what is wrong."""
    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"journal snapshot manifest {where}: {msg}")

    doc = open_manifest(data, where, "journal snapshot manifest")
    check_members(doc, _TOP, bad)
    if doc["kind"] != "journal" or not is_journal_name(doc["name"]) or not 0 <= doc["seq"] < 10**15:
        raise bad("it is not a journal snapshot (kind, name or seq)")
    if name is not None and (doc["name"], doc["seq"]) != (name, seq):
        raise bad(f"it names journal {doc['name']!r} seq {doc['seq']}, not its location's {name!r} seq {seq}")
    check_created(doc, bad)
    stats = doc["stats"]
    if not all(is_uint(stats.get(k)) for k in _STATS):
        raise bad("its stats are incomplete")
    if not all(isinstance(p, str) and len(p) == 64 for p in doc["packs"]):
        raise bad("a pack id is invalid")
    entries = doc["entries"]
    if len(entries) != 1 or not isinstance(entries[0], dict):
        raise bad("it must have exactly one entry, the snapshot")
    e = entries[0]
    if e.get("path") != "snapshot" or e.get("type") not in VALUE_TYPES or e.get("chunking") != "cdc" \
            or not is_uint(e.get("size")) or not isinstance(e.get("chunks"), list):
        raise bad("its entry lacks path 'snapshot', a type of 'bytes'/'json', chunking 'cdc', size or chunks")
    if not all(chunk_row_ok(r) for r in e["chunks"]) or any(r[4] > MAX_SNAPSHOT_CHUNK for r in e["chunks"]):
        raise bad("its snapshot has a malformed or oversized chunk row")
    held = chunk_bytes(e["chunks"], len(doc["packs"]), "snapshot", bad)
    if held != e["size"] or stats["logical_bytes"] != held:
        raise bad(f"its chunks hold {held} bytes, its entry and stats say {e['size']} and {stats['logical_bytes']}")
    return doc

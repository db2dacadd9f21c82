"""Journal snapshot manifests: build, seal, parse and validate (docs/format.md §16.3)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..errors import CorruptManifestError
from ..format import refuse_newer
from ..format.canonical import SealError, parse_object, seal, verify_seal
from ..format.manifest import chunk_bytes
from ..format.names import is_hex64
from ..format.pack import CODECS
from .names import is_journal_name

JOURNAL_FORMAT_VERSION = 4  # docs/format.md §1: journals and index snapshots arrived with format 4
VALUE_TYPES = ("bytes", "json")
MAX_SNAPSHOT_CHUNK = 1 << 20  # the content-defined chunker's maximum: a row declaring more is damage
_TOP = {"format_version": int, "kind": str, "name": str, "seq": int, "created": str, "metadata": dict,
        "packs": list, "entries": list, "stats": dict}
_STATS = ("logical_bytes", "chunks", "new_chunks", "new_bytes", "stored_bytes", "new_packs", "records")


def _is_uint(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _row_ok(row: object) -> bool:
    return (isinstance(row, list) and len(row) == 7 and is_hex64(row[0]) and all(_is_uint(x) for x in row[1:5])
            and row[5] in CODECS and isinstance(row[6], str) and len(row[6]) == 32)


def seal_snapshot_manifest(doc: dict[str, Any]) -> bytes:
    return seal(doc)


def parse_snapshot_manifest(data: bytes, where: str, name: str | None = None, seq: int | None = None
                            ) -> dict[str, Any]:
    """Parse and fully validate a journal snapshot manifest; CorruptManifestError names what is wrong."""
    def bad(msg: str) -> CorruptManifestError:
        return CorruptManifestError(f"journal snapshot manifest {where}: {msg}")

    try:
        obj = parse_object(data)
        refuse_newer(obj, where)
        doc = verify_seal(obj)
    except SealError as exc:
        raise CorruptManifestError(f"journal snapshot manifest {where} is damaged: {exc}") from None
    for key, kind in _TOP.items():
        value = doc.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"member {key!r} is missing or not a {kind.__name__}")
    if doc["kind"] != "journal" or not is_journal_name(doc["name"]) or not 0 <= doc["seq"] < 10**15:
        raise bad("it is not a journal snapshot (kind, name or seq)")
    if name is not None and (doc["name"], doc["seq"]) != (name, seq):
        raise bad(f"it names journal {doc['name']!r} seq {doc['seq']}, not its location's {name!r} seq {seq}")
    try:
        created = datetime.fromisoformat(doc["created"].replace("Z", "+00:00"))
    except ValueError:
        created = None
    if created is None or created.utcoffset() is None:
        raise bad("its created time is not an ISO-8601 time with a timezone")
    stats = doc["stats"]
    if not all(_is_uint(stats.get(k)) for k in _STATS):
        raise bad("its stats are incomplete")
    if not all(isinstance(p, str) and len(p) == 64 for p in doc["packs"]):
        raise bad("a pack id is invalid")
    entries = doc["entries"]
    if len(entries) != 1 or not isinstance(entries[0], dict):
        raise bad("it must have exactly one entry, the snapshot")
    e = entries[0]
    if e.get("path") != "snapshot" or e.get("type") not in VALUE_TYPES or e.get("chunking") != "cdc" \
            or not _is_uint(e.get("size")) or not isinstance(e.get("chunks"), list):
        raise bad("its entry lacks path 'snapshot', a type of 'bytes'/'json', chunking 'cdc', size or chunks")
    if not all(_row_ok(r) for r in e["chunks"]) or any(r[4] > MAX_SNAPSHOT_CHUNK for r in e["chunks"]):
        raise bad("its snapshot has a malformed or oversized chunk row")
    held = chunk_bytes(e["chunks"], len(doc["packs"]), "snapshot", bad)
    if held != e["size"] or stats["logical_bytes"] != held:
        raise bad(f"its chunks hold {held} bytes, its entry and stats say {e['size']} and {stats['logical_bytes']}")
    return doc

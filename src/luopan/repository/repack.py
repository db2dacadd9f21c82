"""gc's repack phase: copy the live chunks of mostly-dead packs into new packs and relocate manifest rows
(docs/format.md §10.3)."""

from __future__ import annotations

import json
from typing import Any

import blake3

from ..errors import CorruptPackError, StorageError
from ..format.canonical import canonical
from ..format.manifest import Row, manifest_rows, stored_rows
from ..format.names import pack_key
from ..format.pack import PackBuilder, PackFormatError
from ..store.base import KeyNotFound, Store
from ..format.codecs import decode_blob
from .chunkio import read_trailer
from .gcreport import GcReport

_PACK, _OFFSET, _CODEC = (Row._fields.index(f) for f in ("pack", "offset", "codec"))  # Row positions (relocation)
Moved = dict[tuple[str, str], tuple[str, int, int, int, str]]  # (old pack, hash) -> new location


def _verify_blob(data: bytes, h: str, size: int, codec: str) -> None:
    raw = decode_blob(codec, data, size, f"chunk {h[:16]}…")
    if len(raw) != size or blake3.blake3(raw).hexdigest() != h:
        raise CorruptPackError(f"chunk {h[:16]}… does not match its hash")


def trailer_blobs(store: Store, pack: str) -> list[dict[str, Any]]:
    try:
        computed, blobs = read_trailer(store, pack)
    except (KeyNotFound, PackFormatError, StorageError):
        return []
    if computed != pack:
        return []
    return [{k: b[k] for k in ("hash", "offset", "length", "size", "codec")} for b in blobs]


def repack(store: Store, pack_size: int, sparse: list[str], live: dict[str, dict[str, tuple[int, int, int, str]]],
           report: GcReport) -> tuple[Moved, dict[str, list[dict[str, Any]]]]:
    """Copy the live blobs of ``sparse`` packs into new packs (verified on the way). Returns the relocation map and
    the new packs' blob records. A pack with a damaged live blob is not repacked (it stays; `verify` names it)."""
    moved: dict[tuple[str, str], tuple[str, int, int, int, str]] = {}
    written: dict[str, list[dict[str, Any]]] = {}
    builder = PackBuilder()
    pending: list[tuple[str, str]] = []  # (old pack, hash) in the builder
    held: list[bytes] = []

    def flush() -> None:
        nonlocal builder, pending, held
        if not builder.blobs:
            return
        pack_id, parts, _total = builder.finish()
        store.put_if_absent(pack_key(pack_id), parts)
        written[pack_id] = builder.blobs
        for (old, h), blob in zip(pending, builder.blobs):
            moved[(old, h)] = (pack_id, blob["offset"], blob["length"], blob["size"], blob["codec"])
        builder, pending, held = PackBuilder(), [], []

    for old in sparse:
        key = pack_key(old)
        blobs = []
        try:
            for h, (off, length, size, codec) in sorted(live[old].items(), key=lambda kv: kv[1][0]):
                data = store.get_range(key, off, length)
                if len(data) != length:
                    raise CorruptPackError("truncated")
                _verify_blob(data, h, size, codec)
                blobs.append((h, data, size, codec))
        except (CorruptPackError, KeyNotFound) as exc:
            report.skipped_repacks.append(f"{old}: {exc}")
            continue
        for h, data, size, codec in blobs:
            held.append(data)
            builder.add(h, memoryview(data), size, codec)
            pending.append((old, h))
            report.copied_bytes += len(data)
        report.repacked_packs += 1
        report.repacked_bytes += store.size(key)
        if builder.nbytes >= pack_size:
            flush()
    flush()
    report.new_packs = len(written)
    return moved, written


def relocated(doc: dict[str, Any], moved: Moved) -> dict[str, Any] | None:
    """A copy of manifest ``doc`` with rows in moved packs pointing at their new locations (None if none moved)."""
    old_packs = doc["packs"]
    if not any((old_packs[r.pack], r.hash) in moved for r in manifest_rows(doc)):
        return None
    new = _deep_copy(doc)
    # A grouped manifest (§8.5) is rewritten with its entries inline: its groups' rows name the old locations, and
    # the document already holds every entry expanded.
    new.pop("groups", None)
    packs: dict[str, int] = {}
    for e in new["entries"]:
        for raw in stored_rows(e):  # updated in place: the positions of Row's fields
            r = Row._make(raw)
            loc = moved.get((old_packs[r.pack], r.hash))
            if loc is None:
                raw[_PACK] = packs.setdefault(old_packs[r.pack], len(packs))
            else:
                pack_id, off, length, size, codec = loc
                raw[_PACK] = packs.setdefault(pack_id, len(packs))
                raw[_OFFSET:_CODEC + 1] = [off, length, size, codec]
    new["packs"] = list(packs)
    return new


def _deep_copy(doc: dict[str, Any]) -> dict[str, Any]:
    return json.loads(canonical(doc))

"""Storing a journal snapshot in the repository and reading it back (docs/format.md §16.3): the snapshot's bytes cut
into content-defined chunks, so what did not change since the previous snapshot is stored once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pyfastcdc import FastCDC

from ..errors import CheckpointExistsError, CorruptManifestError, UsageError
from ..format.canonical import json_culprit
from ..format.limits import MAX_MANIFEST_BYTES
from ..repository.chunkio import ChunkRef, read_chunks
from ..repository.chunkstore import store_chunks
from ..repository.core import Repository
from ..store.base import KeyNotFound
from ..units import format_bytes
from .kind import JOURNAL_KIND
from .manifest import JOURNAL_FORMAT_VERSION, parse_snapshot_manifest, seal_snapshot_manifest
from .names import snapshot_key

CDC_MIN, CDC_AVG, CDC_MAX = 16 << 10, 64 << 10, 1 << 20


@dataclass(frozen=True)
class Snapshot:
    """A journal snapshot: ``value`` stands for every record with a seq below ``seq``."""

    name: str
    seq: int
    value: Any  # bytes or a JSON object (dict), as given to compact()
    created: str
    metadata: dict[str, Any]
    logical_bytes: int
    new_bytes: int  # bytes of chunks this snapshot added to the repository (the rest was shared)


def key_culprit(value: Any, path: str, depth: int = 0) -> str | None:
    """Where a dict in ``value`` has a key that is not a string (JSON would turn it into one, so the record would come
    back changed), e.g. ``the key 1 in record['a']``; None when every key is a string."""
    if depth > 200:
        return None  # json.dumps refuses it for its depth
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"the key {k!r} in {path}"
            found = key_culprit(v, f"{path}[{k!r}]", depth + 1)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = key_culprit(v, f"{path}[{i}]", depth + 1)
            if found:
                return found
    return None


def encode_value(value: Any) -> tuple[str, bytes]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, dict):
        culprit = key_culprit(value, "snapshot") or json_culprit(value, "snapshot")
        if culprit is not None:
            raise UsageError(f"a journal snapshot is bytes or a JSON-able dict: {culprit}")
        return "json", json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True,
                                  allow_nan=False).encode()
    raise UsageError(f"a journal snapshot is bytes or a JSON-able dict, not {type(value).__name__}")


def decode_value(kind: str, data: bytes, where: str) -> Any:
    if kind == "bytes":
        return data
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise CorruptManifestError(f"{where}: the snapshot is not the JSON its manifest says: {exc}") from None
    if not isinstance(value, dict):
        raise CorruptManifestError(f"{where}: the snapshot is not a JSON object")
    return value


def _cdc(data: bytes) -> Iterator[tuple[int, memoryview]]:
    view = memoryview(data)
    for c in FastCDC(avg_size=CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX).cut_buf(view):
        yield 0, view[c.offset : c.offset + c.length]


def store_snapshot(repo: Repository, name: str, seq: int, value: Any, metadata: dict[str, Any],
                   records: int) -> dict[str, Any]:
    """Commit the snapshot covering records < ``seq`` (packs, index file, then the manifest with put_if_absent);
    returns its manifest document. A snapshot at ``seq`` already committed with the same bytes is returned as is."""
    kind, data = encode_value(value)
    key = snapshot_key(name, seq)
    with repo.transaction(JOURNAL_KIND, name, seq, what=f"snapshot of journal {name}", estimate=len(data),
                          purpose=f"snapshot of journal {name!r}", format_version=JOURNAL_FORMAT_VERSION) as tx:
        stored = store_chunks(tx.chunks(crash_label="journal.chunk.written", copy_raw=True), lambda: _cdc(data), 1)
        packs: dict[str, int] = {}
        rows = []
        for h, size, x in stored.rows[0]:
            loc = stored.location(h)
            rows.append([h, packs.setdefault(loc.pack, len(packs)), loc.offset, loc.length, size, loc.codec, x])
        doc: dict[str, Any] = {
            "format_version": JOURNAL_FORMAT_VERSION, "kind": "journal", "name": name, "seq": seq,
            "created": datetime.now(timezone.utc).isoformat(), "metadata": metadata, "packs": list(packs),
            "entries": [{"path": "snapshot", "type": kind, "size": len(data), "chunking": "cdc", "chunks": rows}],
            "stats": {"logical_bytes": len(data), "chunks": len(rows), "new_chunks": stored.new_chunks,
                      "new_bytes": stored.new_bytes, "stored_bytes": stored.stored_bytes,
                      "new_packs": stored.new_packs, "records": records},
        }
        blob = seal_snapshot_manifest(doc)
        if len(blob) > MAX_MANIFEST_BYTES:
            raise UsageError(f"the manifest of this snapshot would be {format_bytes(len(blob))}, more than readers "
                             f"accept ({format_bytes(MAX_MANIFEST_BYTES)})")
        # a put that raised is taken back: else a retry would find it and drop segments it may not stand for
        if tx.put_manifest(blob):
            return doc  # a tiered repository replicates the snapshot like any manifest (§10.2): a commit listener
    existing = parse_snapshot_manifest(repo.store.get_limited(key, MAX_MANIFEST_BYTES), key, name, seq)
    if [r[0] for r in existing["entries"][0]["chunks"]] == [r[0] for r in rows] \
            and existing["entries"][0]["type"] == kind:
        return existing
    raise CheckpointExistsError(f"journal {name!r} already has a different snapshot at seq {seq}: append the records "
                                "that changed the state before compacting again")


def read_snapshot(repo: Repository, doc: dict[str, Any], key: str) -> Snapshot:
    """The snapshot a manifest describes, every chunk verified against its BLAKE3 as it is read."""
    e = doc["entries"][0]
    owner = f"journal {doc['name']!r} snapshot {doc['seq']}"
    out = bytearray(e["size"])
    view = memoryview(out)
    jobs, pos = [], 0
    for n, r in enumerate(e["chunks"]):
        ref = ChunkRef(owner, "snapshot", n, r[0], doc["packs"][r[1]], r[2], r[3], r[4], r[5])
        jobs.append((ref, view[pos : pos + r[4]]))
        pos += r[4]
    try:
        read_chunks(repo.store, jobs)
    except KeyNotFound as exc:  # pragma: no cover  (read_chunks raises typed errors)
        raise CorruptManifestError(f"{key}: {exc}") from None
    s = doc["stats"]
    return Snapshot(doc["name"], doc["seq"], decode_value(e["type"], bytes(out), key), doc["created"],
                    dict(doc["metadata"]), s["logical_bytes"], s["new_bytes"])

"""The save pipeline: chunk → hash (both cores) → dedup → pack → index → manifest → ref (docs/format.md §10)."""

from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import blake3
import xxhash

from .._crash import crashpoint
from ..format import BASE_FORMAT_VERSION
from ..errors import CheckpointExistsError, LuopanError, UnsupportedValueError
from ..format.canonical import sealed_checksum
from ..format.chunking import chunk_spans
from ..format.config import RepoConfig
from ..format.index import build_index
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import Row, encode_metrics, seal_manifest, structure_fingerprint
from ..format.names import index_key, latest_ref_key, manifest_key
from ..format.refs import build_ref
from ..format.pack import BlobLocation, PackBuilder
from ..store.base import Store
from .environment import code_version, environment
from ..repository.parallel import WORKERS, ordered_map
from ..repository.packwriter import PackChecker, PackWriter, compressor, exists_quietly
from .request import SaveRequest
from .rowdelta import Decision, DeltaPolicy, RowTrack, plan_table

# Chunks below this are hashed on the calling thread: handing a small chunk to a worker costs more than hashing
# it (a LoRA re-save of 2,000 small tensors spent 0.18 s waiting on worker handoffs).
INLINE_BYTES = 256 << 10
# Larger chunks go to a worker up to this many bytes per handoff (fewer handoffs; memory ahead stays bounded).
GROUP_BYTES = 16 << 20


@dataclass
class SaveResult:
    manifest_key: str
    doc: dict[str, Any]
    new_locations: dict[str, BlobLocation]
    index_key: str | None  # the index file this save wrote (its chunks are new_locations)
    tracks: dict[str, RowTrack] = field(default_factory=dict)  # row-delta state of table entries after this save


@dataclass
class WriteContext:
    """What a save knows besides its request: the repository, the chunks it holds, and this process's history of the
    run (the previous save's rows for XXH3 change detection, row-delta tracks)."""

    store: Store
    config: RepoConfig
    known: dict[str, BlobLocation]  # chunk hash -> location, from the index files
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> entry of this run's previous save
    tracks: dict[str, RowTrack] = field(default_factory=dict)  # path -> row-delta state (docs/format.md §5.2)
    policy: DeltaPolicy = field(default_factory=DeltaPolicy)
    intact_packs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # pack id -> signature when found intact


def write_checkpoint(ctx: WriteContext, req: SaveRequest) -> SaveResult:
    """Write the chunks the store lacks, then index, manifest and ref. Returns the committed manifest.

    ``previous`` maps entry paths of the run's previous checkpoint (saved by this process) to their manifest
    entries: a chunk whose XXH3-128 and size equal the previous row at the same position reuses that row's BLAKE3
    address without computing it (docs/format.md §5.1). Leaves in ``unchanged`` (tier 1: the caller vouches their
    bytes equal the previous save's) take the previous entry's chunks (and row delta) without being read at all.
    ``tracks`` (row-delta state per entry path), ``hints`` (touched rows per path) and ``policy`` decide which
    tables are stored as base + changed rows (§5.2). On any failure before the index file is visible, the packs
    this save wrote are deleted again (nothing can reference them yet). With ``snapshot`` (save_async) the
    leaves of ``unchanged`` were not copied and must not be read: if their previous chunks are gone, the save fails.
    """
    store, config, known, previous, tracks, policy = ctx.store, ctx.config, ctx.known, ctx.previous, ctx.tracks, ctx.policy
    run, step, leaves, unchanged, hints, snapshot = req.run, req.step, req.leaves, req.unchanged, req.hints, req.snapshot
    chunk_size = config.chunk_size
    codec = config.compression.codec
    level = config.compression.level
    intact_packs = ctx.intact_packs
    writer = PackWriter(store, config.pack_size, intact_packs)
    # hash -> (builder, offset, stored length, raw size, codec) for chunks this save adds
    new: dict[str, tuple[PackBuilder, int, int, int, str]] = {}
    entries: list[dict[str, Any]] = []
    # Chunks per target: targets 0..len(leaves)-1 are the entries (for a row delta: its base chunks), later ones
    # the index and values of row deltas. Each chunk is (hash, raw size, xxh3).
    rows: list[list[tuple[str, int, str]]] = []
    deltas: dict[int, tuple[int, int, int, int]] = {}  # entry -> (base step, rows, index target, values target)
    decisions: dict[int, Decision] = {}
    new_bytes = 0

    for leaf in leaves:
        e: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype,
                             "shape": list(leaf.shape), "nbytes": leaf.nbytes}
        if leaf.scalar:
            e["scalar"] = True
        if leaf.alias_of is not None:
            e["alias_of"] = leaf.alias_of
        entries.append(e)
        rows.append([])

    def target() -> int:
        rows.append([])
        return len(rows) - 1

    index_name = None
    checker = PackChecker(store, intact_packs)
    reusable = checker.reusable

    def usable(chunks: list[tuple[str, int, str]]) -> bool:
        return all(h in known and reusable(known[h]) for h, _size, _x in chunks)

    def triples(chunk_rows: list[list[Any]]) -> list[tuple[str, int, str]]:
        return [(r.hash, r.size, r.xxh3) for r in map(Row._make, chunk_rows)]

    skipped = set()
    for i in unchanged:  # tier 1: reuse the previous entry (chunks and row delta) if every chunk is still there
        leaf = leaves[i]
        prev = previous.get(leaf.path)
        if leaf.alias_of is not None or not prev or prev.get("nbytes") != leaf.nbytes or "chunks" not in prev:
            continue
        parts = [triples(prev["chunks"])]
        if "delta" in prev:
            parts += [triples(prev["delta"]["index"]), triples(prev["delta"]["values"])]
        if all(usable(p) for p in parts):
            rows[i] = parts[0]
            entries[i]["chunking"] = prev["chunking"]
            if "delta" in prev:
                it, vt = target(), target()
                rows[it], rows[vt] = parts[1], parts[2]
                deltas[i] = (prev["delta"]["base_step"], prev["delta"]["rows"], it, vt)
            skipped.add(i)

    def items() -> Any:
        for i, leaf in enumerate(leaves):
            if leaf.alias_of is not None or i in skipped:
                continue
            if leaf.frozen is None and snapshot and i in unchanged:
                raise LuopanError(
                    f"save_async of run {run!r} step {step}: entry {leaf.path!r} was not copied (its version "
                    "counter had not moved and its previous chunks were there when save_async was called), but "
                    "those chunks disappeared before the save could reference them; save again")
            data = leaf.host_bytes()
            mode, spans = chunk_spans(leaf.nbytes, leaf.shape, chunk_size)
            entries[i]["chunking"] = mode
            xs: list[str] | None = None
            if policy.eligible(leaf):
                dec = decisions[i] = plan_table(leaf, data, spans, step, tracks.get(leaf.path),
                                                hints.get(leaf.path), policy, usable, pool)
                if dec.delta is not None:  # base chunks (already stored) + changed rows
                    assert dec.track.base_chunks is not None and dec.delta[0].size > 0
                    index, values = dec.delta
                    rows[i] = list(dec.track.base_chunks)
                    it, vt = target(), target()
                    deltas[i] = (dec.track.base_step, int(index.size), it, vt)
                    for t, buf in ((it, memoryview(index.astype("<i8").tobytes())), (vt, values)):
                        for off, length in chunk_spans(len(buf), (len(buf),), chunk_size)[1]:
                            yield t, buf[off : off + length], None, None
                    continue
                xs = dec.xxh
            prev = previous.get(leaf.path, {}).get("chunks", [])
            for k, (off, length) in enumerate(spans):
                yield (i, data[off : off + length], prev[k] if k < len(prev) else None,
                       xs[k] if xs is not None else None)

    def work(item: tuple[int, memoryview, list[Any] | None, str | None]
             ) -> tuple[int, str, memoryview, int, str, str]:
        i, view, prev, x = item
        if x is None:
            x = xxhash.xxh3_128_hexdigest(view)  # ~2x BLAKE3's speed here: the cheap change detector
        if prev is not None and prev[6] == x and prev[4] == len(view):
            h = prev[0]  # unchanged since the previous save: its content address stands
        else:
            h = blake3.blake3(view).hexdigest()
        if codec == "zstd" and h not in known:
            z = compressor(level).compress(view)
            if len(z) < len(view):
                return i, h, memoryview(z), len(view), "zstd", x
        return i, h, view, len(view), "none", x

    pool = ThreadPoolExecutor(WORKERS, "luopan-hash")
    try:
        with pool:
            for i, h, stored, size, blob_codec, x in ordered_map(
                    pool, work, items(), window=2 * WORKERS, inline=lambda item: len(item[1]) < INLINE_BYTES,
                    group=lambda item: len(item[1]), group_size=GROUP_BYTES):
                rows[i].append((h, size, x))
                if h in new:
                    continue
                if h in known:
                    if reusable(known[h]):
                        continue
                    del known[h]  # stale index entry: store the chunk again
                builder, off = writer.add(h, stored, size, blob_codec)
                new[h] = (builder, off, len(stored), size, blob_codec)
                new_bytes += size
                crashpoint("chunk.written")
        writer.finish()
        if writer.written:
            index_id, index_bytes = build_index(writer.written)
            index_name = index_key(index_id)
            store.put_if_absent(index_name, index_bytes)
    except BaseException:
        writer.close()
        # Once the index is visible (even if its put then failed, e.g. in the directory fsync) other writers may
        # dedup against these packs: from then on they are left to garbage collection, never deleted here.
        if index_name is None or not exists_quietly(store, index_name):
            writer.discard()
        raise
    writer.close()

    # Manifest: every chunk of every entry with its location (self-contained, no chains).
    pack_ids: dict[str, int] = {}
    new_locations: dict[str, BlobLocation] = {}
    for h, (builder, off, length, size, blob_codec) in new.items():
        assert builder.pack_id is not None
        new_locations[h] = BlobLocation(builder.pack_id, off, length, size, blob_codec)

    def manifest_rows(t: int) -> list[list[Any]]:
        out = []
        for h, _size, x in rows[t]:
            loc = new_locations.get(h) or known[h]
            p = pack_ids.setdefault(loc.pack, len(pack_ids))
            out.append([h, p, loc.offset, loc.length, loc.size, loc.codec, x])
        return out

    for i, e in enumerate(entries):
        if "alias_of" in e:
            continue
        e["chunks"] = manifest_rows(i)
        e.setdefault("chunking", "flat")
        if i in deltas:
            base_step, nrows, it, vt = deltas[i]
            e["delta"] = {"base_step": base_step, "rows": nrows, "index": manifest_rows(it),
                          "values": manifest_rows(vt)}

    new_tracks: dict[str, RowTrack] = {}
    for i, leaf in enumerate(leaves):
        if i in decisions:
            track = decisions[i].track
            if i not in deltas:  # stored in full: this version is the base for later deltas
                track = dataclasses.replace(track, base_step=step, base_chunks=rows[i], cycle_bytes=leaf.nbytes,
                                            cycle_saves=1)
            new_tracks[leaf.path] = track
        elif i in skipped and leaf.path in tracks:
            new_tracks[leaf.path] = tracks[leaf.path]

    doc: dict[str, Any] = {
        "format_version": 2 if deltas else BASE_FORMAT_VERSION,  # §1: the oldest version that describes it
        "run": run,
        "step": step,
        "created": datetime.now(timezone.utc).isoformat(),
        "metrics": encode_metrics(req.metrics),
        "metadata": dict(req.metadata or {}),
        "environment": environment(),
        "fingerprint": structure_fingerprint(entries),
        "packs": list(pack_ids),
        "entries": entries,
        "tree": req.skeleton,
        "stats": {
            "logical_bytes": sum(e["nbytes"] for e in entries if "alias_of" not in e),
            "chunks": sum(len(r) for r in rows),
            "new_chunks": len(new),
            "new_bytes": new_bytes,
            "stored_bytes": writer.stored_bytes,
            "new_packs": len(writer.written),
        },
    }
    code = code_version()
    if code is not None:
        doc["code"] = code
    if req.inputs:
        doc["inputs"] = list(req.inputs)
    data = seal_manifest(doc)  # raises on metadata that is not JSON
    if len(data) > MAX_MANIFEST_BYTES:  # readers refuse larger ones (docs/format.md §11): never commit one
        raise UnsupportedValueError(
            f"the manifest of run {run!r} step {step} would be {len(data)} bytes, more than readers accept "
            f"({MAX_MANIFEST_BYTES}): use a larger chunk_size for this repository, or split the state into runs")
    mkey = manifest_key(run, step)
    try:
        if req.overwrite:
            store.put(mkey, data)
        elif not store.put_if_absent(mkey, data):
            raise CheckpointExistsError(
                f"run {run!r} step {step} was committed by another writer during this save; "
                "pass overwrite=True to replace it"
            )
    except OSError:
        # The manifest may be visible but not durable (e.g. the directory fsync failed). A save that raises must
        # not leave a checkpoint behind, so take ours back (best effort) before reporting the failure.
        if not req.overwrite:
            _retract(store, mkey, data)
        raise
    # The checkpoint is committed now. The ref is advisory (docs/format.md §9): failing to update it must not
    # report the save as failed, or a caller would retry a step that already exists.
    try:
        store.put(latest_ref_key(run), build_ref(run, step, sealed_checksum(data)))
    except OSError as exc:
        warnings.warn(f"checkpoint {run!r} step {step} is committed, but its latest ref could not be updated "
                      f"({exc}); readers ignore a stale ref and the next save repairs it", stacklevel=3)
    return SaveResult(mkey, doc, new_locations, index_name, new_tracks)


def _retract(store: Store, key: str, data: bytes) -> None:
    try:
        if store.get(key) == data:
            store.delete(key)
    except OSError:
        pass

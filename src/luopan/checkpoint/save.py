"""The save pipeline: chunk → hash (both cores) → dedup → pack → index → manifest → ref (docs/format.md §10)."""

from __future__ import annotations

import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Iterator
from typing import Any

import blake3
import xxhash

from .. import typed
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
from ..repository.blobcodec import encode_blob
from ..repository.packwriter import PackChecker, PackWriter, exists_quietly
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

    ``ctx.previous`` maps entry paths of the run's previous checkpoint (saved by this process) to their manifest
    entries: a chunk whose XXH3-128 and size equal the previous row at the same position reuses that row's BLAKE3
    address without computing it (docs/format.md §5.1). Leaves in ``req.unchanged`` (tier 1: the caller vouches their
    bytes equal the previous save's) take the previous entry's chunks (and row delta) without being read at all.
    ``ctx.tracks`` (row-delta state per entry path), ``req.hints`` (touched rows per path) and ``ctx.policy`` decide
    which tables are stored as base + changed rows (§5.2). On any failure before the index file is visible, the packs
    this save wrote are deleted again (nothing can reference them yet). With ``req.snapshot`` (save_async) the leaves
    of ``unchanged`` were not copied and must not be read: if their previous chunks are gone, the save fails.
    """
    w = _CheckpointWriter(ctx, req)
    w.reuse_unchanged()
    w.store_chunks()
    doc = w.manifest()
    return w.commit(doc)


class _CheckpointWriter:
    """One save in four stages: reuse unchanged entries, store the chunks the store lacks (packs, then the index
    file), build the manifest, commit it (then the ref)."""

    def __init__(self, ctx: WriteContext, req: SaveRequest) -> None:
        self.ctx, self.req = ctx, req
        self.writer = PackWriter(ctx.store, ctx.config.pack_size, ctx.intact_packs)
        self.checker = PackChecker(ctx.store, ctx.intact_packs)
        # hash -> (builder, offset, stored length, raw size, codec) for chunks this save adds
        self.new: dict[str, tuple[PackBuilder, int, int, int, str]] = {}
        self.new_bytes = 0
        self.new_locations: dict[str, BlobLocation] = {}
        self.index_name: str | None = None
        # Chunks per target: targets 0..len(leaves)-1 are the entries (for a row delta: its base chunks), later ones
        # the index and values of row deltas. Each chunk is (hash, raw size, xxh3).
        self.rows: list[list[tuple[str, int, str]]] = []
        self.deltas: dict[int, tuple[int, int, int, int]] = {}  # entry -> (base step, rows, index/values targets)
        self.decisions: dict[int, Decision] = {}
        self.skipped: set[int] = set()
        self.entries: list[dict[str, Any]] = []
        self.itemsizes: list[int] = []  # per target: element width for the float codec (0: unknown)
        for leaf in req.leaves:
            e: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype,
                                 "shape": list(leaf.shape), "nbytes": leaf.nbytes}
            if leaf.scalar:
                e["scalar"] = True
            if leaf.alias_of is not None:
                e["alias_of"] = leaf.alias_of
            self.entries.append(e)
            self.rows.append([])
            self.itemsizes.append(leaf.itemsize if leaf.float_like else 0)

    def _target(self, itemsize: int = 0) -> int:
        self.rows.append([])
        self.itemsizes.append(itemsize)
        return len(self.rows) - 1

    def _usable(self, chunks: list[tuple[str, int, str]]) -> bool:
        known = self.ctx.known
        return all(h in known and self.checker.reusable(known[h]) for h, _size, _x in chunks)

    # -- stage 1 ----------------------------------------------------------------------------------------------
    def reuse_unchanged(self) -> None:
        """Tier 1: reuse the previous entry (chunks and row delta) of each unchanged leaf whose chunks are all
        still there."""
        def triples(chunk_rows: list[list[Any]]) -> list[tuple[str, int, str]]:
            return [(r.hash, r.size, r.xxh3) for r in map(Row._make, chunk_rows)]

        for i in self.req.unchanged:
            leaf = self.req.leaves[i]
            prev = self.ctx.previous.get(leaf.path)
            if leaf.alias_of is not None or not prev or prev.get("nbytes") != leaf.nbytes or "chunks" not in prev:
                continue
            parts = [triples(prev["chunks"])]
            if "delta" in prev:
                parts += [triples(prev["delta"]["index"]), triples(prev["delta"]["values"])]
            if all(self._usable(p) for p in parts):
                self.rows[i] = parts[0]
                self.entries[i]["chunking"] = prev["chunking"]
                if "delta" in prev:
                    it, vt = self._target(), self._target()
                    self.rows[it], self.rows[vt] = parts[1], parts[2]
                    self.deltas[i] = (prev["delta"]["base_step"], prev["delta"]["rows"], it, vt)
                self.skipped.add(i)

    # -- stage 2 ----------------------------------------------------------------------------------------------
    def _items(self, pool: ThreadPoolExecutor) -> Iterator[tuple[int, memoryview, list[Any] | None, str | None]]:
        """(target, chunk bytes, previous row, precomputed XXH3) of every chunk to hash, in manifest order."""
        req, ctx, chunk_size = self.req, self.ctx, self.ctx.config.chunk_size
        for i, leaf in enumerate(req.leaves):
            if leaf.alias_of is not None or i in self.skipped:
                continue
            if leaf.frozen is None and req.snapshot and i in req.unchanged:
                raise LuopanError(
                    f"save_async of run {req.run!r} step {req.step}: entry {leaf.path!r} was not copied (its "
                    "version counter had not moved and its previous chunks were there when save_async was called), "
                    "but those chunks disappeared before the save could reference them; save again")
            data = leaf.host_bytes()
            mode, spans = chunk_spans(leaf.nbytes, leaf.shape, chunk_size)
            self.entries[i]["chunking"] = mode
            xs: list[str] | None = None
            if ctx.policy.eligible(leaf):
                dec = self.decisions[i] = plan_table(leaf, data, spans, req.step, ctx.tracks.get(leaf.path),
                                                     req.hints.get(leaf.path), ctx.policy, self._usable, pool)
                if dec.delta is not None:  # base chunks (already stored) + changed rows
                    assert dec.track.base_chunks is not None and dec.delta[0].size > 0
                    index, values = dec.delta
                    self.rows[i] = list(dec.track.base_chunks)
                    it, vt = self._target(), self._target()
                    self.deltas[i] = (dec.track.base_step, int(index.size), it, vt)
                    for t, buf in ((it, memoryview(index.astype("<i8").tobytes())), (vt, values)):
                        for off, length in chunk_spans(len(buf), (len(buf),), chunk_size)[1]:
                            yield t, buf[off : off + length], None, None
                    continue
                xs = dec.xxh
            prev = ctx.previous.get(leaf.path, {}).get("chunks", [])
            for k, (off, length) in enumerate(spans):
                yield (i, data[off : off + length], prev[k] if k < len(prev) else None,
                       xs[k] if xs is not None else None)

    def _work(self, item: tuple[int, memoryview, list[Any] | None, str | None]
              ) -> tuple[int, str, memoryview, int, str, str]:
        i, view, prev, x = item
        if x is None:
            x = xxhash.xxh3_128_hexdigest(view)  # ~2x BLAKE3's speed here: the cheap change detector
        if prev is not None and prev[6] == x and prev[4] == len(view):
            h = prev[0]  # unchanged since the previous save: its content address stands
        else:
            h = blake3.blake3(view).hexdigest()
        if h not in self.ctx.known:
            codec, stored = encode_blob(view, self.ctx.config.compression, self._itemsize(i))
            return i, h, stored, len(view), codec, x
        return i, h, view, len(view), "none", x

    def _itemsize(self, target: int) -> int:
        """Element width of a target's bytes for the float codec (0: not one numeric type)."""
        return self.itemsizes[target] if target < len(self.itemsizes) else 0

    def store_chunks(self) -> None:
        """Hash every chunk on both cores, write those the store lacks into packs, then the index file naming
        them. On failure before the index file is visible, the packs written are deleted again."""
        store, known, writer = self.ctx.store, self.ctx.known, self.writer
        pool = ThreadPoolExecutor(WORKERS, "luopan-hash")
        try:
            with pool:
                for i, h, stored, size, blob_codec, x in ordered_map(
                        pool, self._work, self._items(pool), window=2 * WORKERS,
                        inline=lambda item: len(item[1]) < INLINE_BYTES, group=lambda item: len(item[1]),
                        group_size=GROUP_BYTES):
                    self.rows[i].append((h, size, x))
                    if h in self.new:
                        continue
                    if h in known:
                        if self.checker.reusable(known[h]):
                            continue
                        del known[h]  # stale index entry: store the chunk again
                    builder, off = writer.add(h, stored, size, blob_codec)
                    self.new[h] = (builder, off, len(stored), size, blob_codec)
                    self.new_bytes += size
                    crashpoint("chunk.written")
            writer.finish()
            if writer.written:
                index_id, index_bytes = build_index(writer.written)
                self.index_name = index_key(index_id)
                store.put_if_absent(self.index_name, index_bytes)
        except BaseException:
            writer.close()
            # Once the index is visible (even if its put then failed, e.g. in the directory fsync) other writers may
            # dedup against these packs: from then on they are left to garbage collection, never deleted here.
            if self.index_name is None or not exists_quietly(store, self.index_name):
                writer.discard()
            raise
        writer.close()
        for h, (builder, off, length, size, blob_codec) in self.new.items():
            assert builder.pack_id is not None
            self.new_locations[h] = BlobLocation(builder.pack_id, off, length, size, blob_codec)

    # -- stage 3 ----------------------------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        """The manifest: every chunk of every entry with its location (self-contained, no chains)."""
        req, entries, rows, deltas = self.req, self.entries, self.rows, self.deltas
        pack_ids: dict[str, int] = {}

        def manifest_rows(t: int) -> list[list[Any]]:
            out = []
            for h, _size, x in rows[t]:
                loc = self.new_locations.get(h) or self.ctx.known[h]
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
        doc: dict[str, Any] = {
            # §1: the oldest version that describes it (3: typed values; 2: row deltas)
            "format_version": (typed.TYPED_FORMAT_VERSION if typed.present(req.skeleton)
                               else 2 if deltas else BASE_FORMAT_VERSION),
            "run": req.run,
            "step": req.step,
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
                "new_chunks": len(self.new),
                "new_bytes": self.new_bytes,
                "stored_bytes": self.writer.stored_bytes,
                "new_packs": len(self.writer.written),
            },
        }
        code = code_version()
        if code is not None:
            doc["code"] = code
        if req.inputs:
            doc["inputs"] = list(req.inputs)
        return doc

    def tracks(self) -> dict[str, RowTrack]:
        """Row-delta state of the table entries after this save (docs/format.md §5.2)."""
        out: dict[str, RowTrack] = {}
        for i, leaf in enumerate(self.req.leaves):
            if i in self.decisions:
                track = self.decisions[i].track
                if i not in self.deltas:  # stored in full: this version is the base for later deltas
                    track = dataclasses.replace(track, base_step=self.req.step, base_chunks=self.rows[i],
                                                cycle_bytes=leaf.nbytes, cycle_saves=1)
                out[leaf.path] = track
            elif i in self.skipped and leaf.path in self.ctx.tracks:
                out[leaf.path] = self.ctx.tracks[leaf.path]
        return out

    # -- stage 4 ----------------------------------------------------------------------------------------------
    def commit(self, doc: dict[str, Any]) -> SaveResult:
        """Commit the manifest (the checkpoint exists from here on), then point the run's ref at it."""
        store, run, step, overwrite = self.ctx.store, self.req.run, self.req.step, self.req.overwrite
        data = seal_manifest(doc)  # raises on metadata that is not JSON
        if len(data) > MAX_MANIFEST_BYTES:  # readers refuse larger ones (docs/format.md §11): never commit one
            raise UnsupportedValueError(
                f"the manifest of run {run!r} step {step} would be {len(data)} bytes, more than readers accept "
                f"({MAX_MANIFEST_BYTES}): use a larger chunk_size for this repository, or split the state into runs")
        mkey = manifest_key(run, step)
        try:
            if overwrite:
                store.put(mkey, data)
            elif not store.put_if_absent(mkey, data):
                raise CheckpointExistsError(
                    f"run {run!r} step {step} was committed by another writer during this save; "
                    "pass overwrite=True to replace it"
                )
        except OSError:
            # The manifest may be visible but not durable (e.g. the directory fsync failed). A save that raises must
            # not leave a checkpoint behind, so take ours back (best effort) before reporting the failure.
            if not overwrite:
                _retract(store, mkey, data)
            raise
        # The checkpoint is committed now. The ref is advisory (docs/format.md §9): failing to update it must not
        # report the save as failed, or a caller would retry a step that already exists.
        try:
            store.put(latest_ref_key(run), build_ref(run, step, sealed_checksum(data)))
        except OSError as exc:
            warnings.warn(f"checkpoint {run!r} step {step} is committed, but its latest ref could not be updated "
                          f"({exc}); readers ignore a stale ref and the next save repairs it", stacklevel=4)
        return SaveResult(mkey, doc, self.new_locations, self.index_name, self.tracks())


def _retract(store: Store, key: str, data: bytes) -> None:
    try:
        if store.get(key) == data:
            store.delete(key)
    except OSError:
        pass

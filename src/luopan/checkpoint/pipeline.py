"""The save pipeline: chunk → hash (both cores) → dedup → pack → index → manifest → ref (docs/format.md §10)."""

from __future__ import annotations

import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from collections.abc import Callable, Iterator
from typing import Any


from .. import typed
from ..tree import Leaf
from ..errors import CheckpointExistsError, IntegrityError, LuopanError
from ..store.base import KeyNotFound
from ..format import BASE_FORMAT_VERSION, ENGINE2_FORMAT_VERSION, SEGMENTS_FORMAT_VERSION
from ..format.chunking import chunk_spans
from ..format.manifest import Row, encode_metrics, stored_rows, structure_fingerprint, uses_new_codecs
from ..format.names import manifest_key, pack_key
from ..format.codecs import encode_blob
from ..repository.chunkwriter import ChunkWriter, Item, stored_plainly
from ..repository.parallel import shared_pool
from .commit import seal_checkpoint, write_latest_ref
from .environment import code_version, environment
from .grouping import GroupStore
from .trackstate import TrackUpdates
from .request import SaveRequest
from .writectx import SaveResult, WriteContext
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk
from .deltaplan import BaseReadError, PlanContext, base_scratch, chunk_xxh3s, plan_entry, xor_into, zero_chunk
from .rowdelta import Decision

# Chunks below this are hashed on the calling thread (handing one chunk to a worker costs more than hashing it);
# larger ones go to the workers in groups, so a LoRA re-save of 2,000 20 KiB tensors hashes on every core.
INLINE_BYTES = 16 << 10
# The XXH3s of delta-tracked entries are computed this far ahead of their planning (_xxh3_ahead).
PREFETCH_BYTES = 64 << 20
# Larger chunks go to a worker up to this many bytes per handoff (fewer handoffs; memory ahead stays bounded).
GROUP_BYTES = 16 << 20


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
    for _attempt in range(len(req.leaves) + 2):  # each retry stops using at least one more damaged base
        w = _CheckpointWriter(ctx, req, ctx.chunks())
        w.reuse_unchanged()
        try:
            w.store_chunks()
        except BaseReadError as exc:  # a base chunk read back for an XOR delta is damaged: nothing was committed
            warnings.warn(f"run {req.run!r} step {req.step}: {exc}; storing the entry in full instead "
                          "(`luopan verify` reports the damage)", stacklevel=3)
            ctx.bad_bases.add(exc.chunk_hash)
            continue
        try:
            doc = w.manifest()
        except BaseException:
            w.chunks.abandon()  # its packs are not indexed yet: nothing can reference them
            raise
        return w.commit(doc, w.store_index(doc))
    raise LuopanError(f"run {req.run!r} step {req.step}: delta bases kept failing to read; run `luopan verify`")


def _in_host_memory(leaf: Leaf) -> bool:
    """Whether ``leaf.host_bytes()`` is a view, not a copy (so reading it twice costs no second copy)."""
    if leaf.frozen is not None:
        return True
    obj = leaf.obj
    if leaf.kind == "numpy":
        flags = getattr(obj, "flags", None)
        return bool(flags is not None and flags.c_contiguous and obj.dtype.byteorder != ">")
    return bool(getattr(obj, "is_cpu", False) and obj.is_contiguous())


class _CheckpointWriter(GroupStore, TrackUpdates):
    """One save in four stages: reuse unchanged entries, store the chunks the store lacks (packs, then the index
    file), build the manifest, commit it (then the ref)."""

    def __init__(self, ctx: WriteContext, req: SaveRequest, chunks: ChunkWriter) -> None:
        self.ctx, self.req = ctx, req
        # The chunk writer: hash, dedup, pack, index (and the crash rule). Its targets 0..len(leaves)-1 are the
        # entries (for a row delta: its base chunks), later ones the index and values of row deltas; ``rows[t]``
        # lists target t's chunks as (hash, raw size, xxh3).
        self.chunks = chunks
        self.deltas: dict[int, tuple[int, int, int, int]] = {}  # entry -> (base step, rows, index/values targets)
        # Patch segments (§5.2, format 7): entry -> rows of each segment, for the manifest (one segment: absent), and
        # entry -> (rows, index chunks, values chunks) of each segment this save planned, for its track.
        self.segment_rows: dict[int, list[int]] = {}
        self.segment_chunks: dict[int, list[tuple[int, int, int]]] = {}
        self.decisions: dict[int, Decision] = {}
        self.xors: dict[int, tuple[int, int]] = {}  # entry -> (base step, target of its XOR chunks)
        self.sizes = PackSizes(ctx.store)
        self.skipped: set[int] = set()
        self.carried: dict[int, dict[str, Any]] = {}  # entry -> the previous save's, named again unread (carry.py)
        self.entries: list[dict[str, Any]] = []
        for leaf in req.leaves:
            e: dict[str, Any] = {"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype,
                                 "shape": list(leaf.shape), "nbytes": leaf.nbytes}
            if leaf.scalar:
                e["scalar"] = True
            if leaf.alias_of is not None:
                e["alias_of"] = leaf.alias_of
            self.entries.append(e)
            chunks.target(leaf.itemsize)

    # the chunk writer's state, by the names the save's stages use
    rows = property(lambda self: self.chunks.rows)
    new = property(lambda self: self.chunks.new)
    new_locations = property(lambda self: self.chunks.new_locations)
    stored_by_target = property(lambda self: self.chunks.stored_by_target)  # what an XOR delta cost
    checker = property(lambda self: self.chunks.checker)

    def _target(self, itemsize: int = 0) -> int:
        return self.chunks.target(itemsize)

    def _usable(self, chunks: list[tuple[str, int, str]]) -> bool:
        known, bad = self.ctx.known, self.ctx.bad_bases
        return all(h in known and h not in bad and self.checker.reusable(known[h]) for h, _size, _x in chunks)

    # -- stage 1 ----------------------------------------------------------------------------------------------
    def reuse_unchanged(self) -> None:
        """Tier 1: reuse the previous entry (chunks and row delta) of each unchanged leaf whose chunks are all
        still there."""
        def triples(chunk_rows: list[list[Any]]) -> list[tuple[str, int, str]]:
            return [(r.hash, r.size, r.xxh3) for r in map(Row._make, chunk_rows)]

        basis, ctx = self.ctx.basis, self.ctx
        for i in self.req.unchanged:
            leaf = self.req.leaves[i]
            carried = None if basis is None else basis.carried(self.entries[i], self.checker, ctx.generation,
                                                                ctx.bad_bases)
            if carried is not None:  # its rows are not touched: the manifest names them (and its groups) again
                self.carried[i] = carried
                self.skipped.add(i)
                continue
            prev = self.ctx.previous.get(leaf.path)
            if leaf.alias_of is not None or not prev or prev.get("nbytes") != leaf.nbytes or "chunks" not in prev:
                continue
            parts = [triples(prev["chunks"])]
            if "delta" in prev:
                parts += [triples(prev["delta"]["index"]), triples(prev["delta"]["values"])]
            elif "xor" in prev:
                parts += [triples(prev["xor"]["chunks"])]
            if all(self._usable(p) for p in parts):
                self.rows[i] = parts[0]
                self.entries[i]["chunking"] = prev["chunking"]
                if "delta" in prev:
                    it, vt = self._target(), self._target(leaf.itemsize)
                    self.rows[it], self.rows[vt] = parts[1], parts[2]
                    self.deltas[i] = (prev["delta"]["base_step"], prev["delta"]["rows"], it, vt)
                    if "segments" in prev["delta"]:
                        self.segment_rows[i] = list(prev["delta"]["segments"])
                elif "xor" in prev:
                    xt = self._target(leaf.itemsize)
                    self.rows[xt] = parts[1]
                    self.xors[i] = (prev["xor"]["base_step"], xt)
                self.skipped.add(i)

    # -- stage 2 ----------------------------------------------------------------------------------------------
    def _items(self, pool: ThreadPoolExecutor) -> Iterator[Item]:
        """(target, chunk bytes, previous row, precomputed XXH3, base chunk to XOR with) of every chunk to hash, in
        manifest order."""
        req, ctx, chunk_size = self.req, self.ctx, self.ctx.config.chunk_size
        compression = ctx.config.compression
        coding = compression.codec != "none"
        pc = PlanContext(ctx.policy, self._usable, self._read_base, pool, coding,
                         lambda view, width, fast: encode_blob(view, compression, width, fast)[1],
                         ctx.config.format_version >= SEGMENTS_FORMAT_VERSION, self._peek_base)
        ahead = self._xxh3_ahead(pool)
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
            prev = ctx.previous.get(leaf.path, {}).get("chunks", [])
            track = ctx.tracks.get(leaf.path)
            if track is not None and not track.base_checked:
                prev = []  # the previous save listed base rows read from disk: their XXH3s decide nothing (§5.5)
            if ctx.policy.tracked(leaf):
                pre = ahead(i)
                try:
                    dec = plan_entry(leaf, data, spans, req.step, track, req.hints.get(leaf.path), pc, pre)
                except BaseReadError as exc:  # read back to compare: damaged. Plan again without that base
                    warnings.warn(f"run {req.run!r} step {req.step} entry {leaf.path!r}: {exc}; storing the entry "
                                  "without that chunk (in full, or as one patch segment; `luopan verify` reports the "
                                  "damage)", stacklevel=4)
                    ctx.bad_bases.add(exc.chunk_hash)
                    dec = plan_entry(leaf, data, spans, req.step, track, req.hints.get(leaf.path), pc, pre)
                self.decisions[i] = dec
                base = dec.track.base_chunks
                if dec.delta is not None or dec.kept:  # base chunks (already stored) + changed rows
                    assert base is not None and (dec.kept or dec.delta[0].size > 0)  # type: ignore[index]
                    self.rows[i] = list(base)
                    it, vt = self._target(), self._target(leaf.itemsize)
                    # Segments kept from the previous save come first, by reference; the new one (if any) after.
                    layout = [(n, len(ix), len(vx)) for n, ix, vx in dec.kept]
                    self.rows[it] = [c for _n, ix, _v in dec.kept for c in ix]
                    self.rows[vt] = [c for _n, _i, vx in dec.kept for c in vx]
                    if dec.delta is None:
                        self._segments(i, dec.track.base_step, it, vt, layout)
                        continue
                    index, values = dec.delta
                    ibuf = memoryview(index.astype("<i8").tobytes())
                    ispans = chunk_spans(len(ibuf), (len(ibuf),), chunk_size)[1]
                    vspans = chunk_spans(len(values), (len(values),), chunk_size)[1]
                    layout.append((int(index.size), len(ispans), len(vspans)))
                    self._segments(i, dec.track.base_step, it, vt, layout)
                    for t, buf, pieces in ((it, ibuf, ispans), (vt, values, vspans)):
                        for off, length in pieces:
                            yield t, buf[off : off + length], None, None, None
                    continue
                if dec.xor:  # base chunks (already stored) + this content XOR the base, chunk by chunk
                    assert base is not None
                    self.rows[i] = list(base)
                    xt = self._target(leaf.itemsize)
                    self.xors[i] = (dec.track.base_step, xt)
                    for k, (off, length) in enumerate(spans):
                        if dec.same is not None and dec.same[k]:  # equal to the base: its XOR is zeros
                            zh, zx, zeros = zero_chunk(length)
                            yield xt, zeros, (zh, length, zx), zx, None
                        else:
                            yield xt, data[off : off + length], None, None, base[k]
                    continue
                xs = dec.xxh
                if dec.hashes is not None:  # BLAKE3 computed by the plan: reuse it
                    prev = [[h, 0, 0, n, n, "none", x] for h, (_o, n), x in zip(dec.hashes, spans, xs)]
            if coding and stored_plainly(ctx.previous.get(leaf.path), leaf.path, req.step):
                self.chunks.plain.add(i)
            for k, (off, length) in enumerate(spans):
                r = prev[k] if k < len(prev) else None  # XXH3 reuse (§5.1): (blake3, size, xxh3) of that row
                yield (i, data[off : off + length], (r[0], r[4], r[6]) if r is not None else None,
                       xs[k] if xs is not None else None, None)

    def _xxh3_ahead(self, pool: ThreadPoolExecutor) -> Callable[[int], list[str] | None]:
        """``ahead(i)``: the XXH3-128s of tracked entry ``i``'s chunks, computed on ``pool`` up to PREFETCH_BYTES
        ahead of the planning, which otherwise waited for each entry's in turn (an unchanged re-save of 256 tracked
        4 MiB matrices hashed on one core at a time). Only entries whose bytes are already in host memory (no copy
        made twice); None for the others, which the plan hashes itself."""
        req, chunk_size, policy = self.req, self.ctx.config.chunk_size, self.ctx.policy
        todo = deque(i for i, leaf in enumerate(req.leaves)
                     if leaf.alias_of is None and i not in self.skipped and policy.tracked(leaf)
                     and _in_host_memory(leaf))
        started: dict[int, Future[list[str]]] = {}
        queued = [0]

        def xxh3s(leaf: Leaf) -> list[str]:
            return chunk_xxh3s(leaf.host_bytes(), chunk_spans(leaf.nbytes, leaf.shape, chunk_size)[1])

        def ahead(i: int) -> list[str] | None:
            while todo and (queued[0] < PREFETCH_BYTES or todo[0] <= i):
                j = todo.popleft()
                started[j] = pool.submit(xxh3s, req.leaves[j])
                queued[0] += req.leaves[j].nbytes
            f = started.pop(i, None)
            if f is None:
                return None
            queued[0] -= req.leaves[i].nbytes
            return f.result()
        return ahead

    def _segments(self, i: int, base_step: int, it: int, vt: int, layout: list[tuple[int, int, int]]) -> None:
        """Record entry ``i``'s row delta: (rows, index chunks, values chunks) of each segment, oldest first."""
        self.deltas[i] = (base_step, sum(n for n, _i, _v in layout), it, vt)
        if self.ctx.config.format_version >= SEGMENTS_FORMAT_VERSION:
            self.segment_chunks[i] = layout
            if len(layout) > 1:
                self.segment_rows[i] = [n for n, _i, _v in layout]

    def _read_base(self, chunk: tuple[str, int, str], k: int) -> memoryview:
        """The verified bytes of a base chunk, in this thread's scratch buffer (BaseReadError when unreadable)."""
        h, size, _x = chunk
        loc = self.ctx.known.get(h)
        if loc is None or loc.size != size:  # gone, or a row whose size is not the chunk's (a crafted manifest)
            raise BaseReadError(h, LuopanError("not in the repository's index with that size"))
        ref = ChunkRef(f"run {self.req.run!r} (a delta base)", "", k, h, loc.pack, loc.offset, loc.length,
                       loc.size, loc.codec)
        buf = base_scratch(size)
        try:
            read_chunk(self.ctx.store, ref, buf, self.sizes)
        except IntegrityError as exc:  # damaged or missing; an unreadable store (StorageError) fails the save
            raise BaseReadError(h, exc) from exc
        return buf

    def _peek_base(self, chunk: tuple[str, int, str], a: int, b: int) -> memoryview:
        """Bytes [a, b) of a base chunk, for the estimate of ``_xor_pays`` only: a chunk stored raw is read in that
        range alone, unverified (16x less than the chunk, and no hash: damage can only sway an estimate, and a delta
        reads and verifies the whole chunk); any other chunk is read whole and verified."""
        h, size, _x = chunk
        loc = self.ctx.known.get(h)
        if loc is not None and loc.codec == "none" and loc.size == size and 0 <= a <= b <= size:
            ref = ChunkRef(f"run {self.req.run!r} (a delta base)", "", 0, h, loc.pack, loc.offset, loc.length,
                           loc.size, loc.codec)
            buf = base_scratch(b - a)
            try:
                self.sizes.check(ref)  # the row fits in its pack
                if self.ctx.store.read_into(pack_key(loc.pack), loc.offset + a, buf) == b - a:
                    return buf
            except (IntegrityError, KeyNotFound):
                pass  # missing or cut short: read whole below, which says so (BaseReadError)
        return self._read_base(chunk, 0)[a:b]

    def _xor(self, item: Item) -> memoryview:
        """A delta item's bytes: this content XOR the base chunk at the same place, in this thread's scratch."""
        return xor_into(item[1], self._read_base(item[4], 0), in_place=True)

    def store_chunks(self) -> None:
        """Hash every chunk on both cores and write those the store lacks into packs (their index file follows the
        manifest's entry groups: ``store_index``). On failure the packs written are deleted again."""
        pool = shared_pool("plan")  # row-delta planning compares rows on it
        self.chunks.write(self._items(pool), prepare=self._xor, inline_bytes=INLINE_BYTES, group_bytes=GROUP_BYTES)

    def store_index(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Store the manifest's entry groups the store lacks (§8.5; a grouped manifest only), then the index file
        naming every pack this save wrote. Returns the document to seal (``doc`` keeps its entries)."""
        try:
            file_doc = self.store_groups(doc)
        except BaseException:
            self.chunks.abandon()
            raise
        self.chunks.write_index()
        if self.ctx.started is not None:  # sealed with the manifest: its commit follows at once (§8)
            took = max(0.0, time.monotonic() - self.ctx.started)
            stall = took if self.ctx.stall is None else min(took, max(0.0, self.ctx.stall))
            # ints: older readers accept them; file_doc shares doc's stats
            doc["stats"].update(save_us=round(took * 1e6), stall_us=round(stall * 1e6))
        return file_doc

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

        carried = self.carried
        for i, e in enumerate(entries):
            if i in carried:  # rows naming pack ids, placed by store_groups (in a group, or inline)
                entries[i] = carried[i]
                for loc in self.ctx.basis.extents(carried[i]):  # its packs, in the order rows would list them
                    pack_ids.setdefault(loc.pack, len(pack_ids))
                continue
            if "alias_of" in e:
                continue
            e["chunks"] = manifest_rows(i)
            e.setdefault("chunking", "flat")
            if i in deltas:
                base_step, nrows, it, vt = deltas[i]
                e["delta"] = {"base_step": base_step, "rows": nrows, "index": manifest_rows(it),
                              "values": manifest_rows(vt), "cycle": self._cycle(i)}
                if i in self.segment_rows:
                    e["delta"]["segments"] = self.segment_rows[i]
            elif i in self.xors:
                base_step, xt = self.xors[i]
                e["xor"] = {"base_step": base_step, "chunks": manifest_rows(xt), "cycle": self._cycle(i)}
        lv = max((self.ctx.basis.level(e) for e in carried.values()), default=1) if carried else 1
        own = [e for i, e in enumerate(entries) if i not in carried] if carried else entries
        doc: dict[str, Any] = {
            # §1: the oldest version that describes it (5: deltas with writer hints, XOR deltas, new codecs;
            # 3: typed values)
            "format_version": (SEGMENTS_FORMAT_VERSION if self.segment_rows or lv >= SEGMENTS_FORMAT_VERSION
                               else ENGINE2_FORMAT_VERSION if deltas or self.xors or lv >= ENGINE2_FORMAT_VERSION
                               or uses_new_codecs(own)
                               else typed.TYPED_FORMAT_VERSION if typed.present(req.skeleton)
                               else BASE_FORMAT_VERSION),
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
                "chunks": sum(len(r) for r in rows) + sum(len(stored_rows(e)) for e in carried.values()),
                "new_chunks": self.chunks.new_chunks,
                "new_bytes": self.chunks.new_bytes,
                "stored_bytes": self.chunks.stored_bytes,
                "new_packs": self.chunks.new_packs,
            },
        }
        code = code_version()
        if code is not None:
            doc["code"] = code
        if req.inputs:
            doc["inputs"] = list(req.inputs)
        return doc

    # -- stage 4 ----------------------------------------------------------------------------------------------
    def commit(self, doc: dict[str, Any], file_doc: dict[str, Any]) -> SaveResult:
        """Commit the manifest (``file_doc``, the sealed form of ``doc``: the checkpoint exists from here on) through
        the write transaction, then point the run's ref at it."""
        req = self.req
        raw, data = seal_checkpoint(file_doc, req.run, req.step,
                                    self.ctx.config.format_version >= ENGINE2_FORMAT_VERSION)
        if not self.ctx.commit(data, req.overwrite):
            raise CheckpointExistsError(f"run {req.run!r} step {req.step} was committed by another writer during this "
                                        "save; pass overwrite=True to replace it")
        write_latest_ref(self.ctx.store, req.run, req.step, raw)
        return SaveResult(manifest_key(req.run, req.step), doc, self.chunks.new_locations, self.chunks.index_key,
                          self.tracks(), self.basis_after(doc))

"""Checkpoints written in parts (docs/format.md §10.5): several processes each store the chunks of their own tensors
(``store_entries``: packs, then an index file, durable before it returns), and one process commits the manifest that
lists them all (``commit_entries``) — only after every part is durable. Until then nothing is visible; a part whose
process died leaves only unreferenced packs for gc. luopan.dcp builds on this."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import blake3
import xxhash

from .. import typed
from ..errors import CheckpointExistsError, MissingPackError, UnsupportedValueError
from ..format import BASE_FORMAT_VERSION, ENGINE2_FORMAT_VERSION
from ..format.canonical import sealed_checksum
from ..format.chunking import chunk_spans
from ..format.canonical import compress_json
from ..format.index import build_index
from ..format.limits import MAX_MANIFEST_BYTES
from ..format.manifest import encode_metrics, parse_manifest, seal_manifest, structure_fingerprint
from ..format.names import check_run, check_step, index_key, latest_ref_key, manifest_key, pack_key
from ..format.pack import ENGINE2_CODECS, BlobLocation
from ..format.refs import build_ref
from ..repository.locks import locked
from ..repository.blobcodec import encode_blob
from ..repository.packwriter import PackChecker, PackWriter, exists_quietly
from ..repository.parallel import WORKERS, ordered_map
from ..tree import flatten
from .environment import code_version, environment
from .info import CheckpointInfo
from .kind import CHECKPOINTS
from .saving import Saving, refuse_pinned


WRITTEN = ("new_chunks", "new_bytes", "stored_bytes", "new_packs")  # what each part wrote, summed into the stats


@dataclass
class StoredEntries:
    """What ``store_entries`` stored: manifest entries (rows naming packs by id) and what it wrote (WRITTEN)."""

    entries: list[dict[str, Any]]
    written: dict[str, int] = field(default_factory=dict)


class Parts(Saving):
    """Checkpoints written in parts by several processes (part of luopan.Repo)."""

    def store_entries(self, tensors: list[tuple[str, Any]]) -> StoredEntries:
        """Store the chunks of ``(key path, tensor or array)`` pairs the repository lacks; returns their manifest
        entries with chunk rows naming packs by id (not an index), for ``commit_entries``, and what was written. The
        packs and their index file are durable when this returns."""
        self.drain()  # a save_async in flight shares the chunk index: let it finish (its error surfaces here)
        leaves = []
        for path, value in tensors:
            _skeleton, found = flatten({"v": value})
            if len(found) != 1 or found[0].alias_of is not None:
                raise UnsupportedValueError(f"store_entries takes one tensor per key path; {path!r} is not one")
            leaf = found[0]
            leaf.path = path
            leaves.append(leaf)
        with locked(self.store, "shared", "a part of a checkpoint", timeout=self.lock_timeout, where=self.where):
            return self._store_locked(leaves)

    def _store_locked(self, leaves: list[Any]) -> StoredEntries:
        known = self.chunk_index()
        compression = self.config.compression
        writer = PackWriter(self.store, self.config.pack_size, self._intact_packs)
        checker = PackChecker(self.store, self._intact_packs)
        rows: list[list[tuple[str, int, str]]] = [[] for _ in leaves]
        new: dict[str, Any] = {}
        entries = []

        previous = self._parts_rows

        def items() -> Any:
            for i, leaf in enumerate(leaves):
                data = leaf.host_bytes()
                mode, spans = chunk_spans(leaf.nbytes, leaf.shape, self.config.chunk_size)
                entries.append({"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype, "shape": list(leaf.shape),
                                "nbytes": leaf.nbytes, "chunking": mode})
                prev = previous.get(leaf.path, [])
                for k, (off, length) in enumerate(spans):
                    yield i, data[off : off + length], prev[k] if k < len(prev) else None

        def work(item: tuple[int, memoryview, tuple[str, int, str] | None]
                 ) -> tuple[int, str, memoryview, int, str, str]:
            i, view, prev = item
            x = xxhash.xxh3_128_hexdigest(view)
            # docs/format.md §5.1: a chunk whose XXH3-128 and size equal this process's previous part at the same
            # place keeps that BLAKE3 address (rows this process computed itself, never ones read from disk)
            h = prev[0] if prev is not None and prev[1] == len(view) and prev[2] == x else \
                blake3.blake3(view).hexdigest()
            if h not in known:
                codec, stored = encode_blob(view, compression, leaves[i].itemsize)
                return i, h, stored, len(view), codec, x
            return i, h, view, len(view), "none", x

        index_name = None
        try:
            with ThreadPoolExecutor(WORKERS, "luopan-part") as pool:
                for i, h, stored, size, blob_codec, x in ordered_map(pool, work, items(), window=2 * WORKERS):
                    rows[i].append((h, size, x))
                    if h in new or (h in known and checker.reusable(known[h])):
                        continue
                    known.pop(h, None)
                    builder, off = writer.add(h, stored, size, blob_codec)
                    new[h] = (builder, off, len(stored), size, blob_codec)
            writer.finish()
            if writer.written:
                index_id, index_bytes = build_index(
                    writer.written, compress=self.config.format_version >= ENGINE2_FORMAT_VERSION)
                index_name = index_key(index_id)
                self.store.put_if_absent(index_name, index_bytes)
        except BaseException:
            writer.close()
            if index_name is None or not exists_quietly(self.store, index_name):
                writer.discard()
            raise
        writer.close()
        locations = {h: BlobLocation(b.pack_id, off, length, size, c) for h, (b, off, length, size, c) in new.items()}
        self.learned(locations, index_name)
        for leaf, entry_rows in zip(leaves, rows):
            self._parts_rows[leaf.path] = entry_rows
        for e, entry_rows in zip(entries, rows):
            e["chunks"] = []
            for h, size, x in entry_rows:
                loc = locations.get(h) or known[h]
                e["chunks"].append([h, loc.pack, loc.offset, loc.length, size, loc.codec, x])
        return StoredEntries(entries, {"new_chunks": len(new), "new_bytes": sum(v[3] for v in new.values()),
                                       "stored_bytes": writer.stored_bytes, "new_packs": len(writer.written)})

    def commit_entries(self, run: str, step: int, entries: list[dict[str, Any]], tree: dict[str, Any], *,
                       metrics: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                       extra: dict[str, Any] | None = None, overwrite: bool = False,
                       written: dict[str, int] | None = None, inputs: list[str] | None = None) -> CheckpointInfo:
        """Commit one manifest listing ``entries`` (from ``store_entries`` of any process) under ``tree`` (a skeleton
        whose ``{"entry": i}`` nodes index ``entries``); ``extra`` members are added to it (e.g. ``dcp``). Raises
        CheckpointExistsError when the step exists (unless ``overwrite``)."""
        check_run(run)
        step = check_step(step)
        if overwrite:
            refuse_pinned(self, run, step)
        packs: dict[str, int] = {}
        out = []
        for e in entries:
            e = dict(e)
            e["chunks"] = [[r[0], packs.setdefault(r[1], len(packs)), *r[2:]] for r in e["chunks"]]
            out.append(e)
        version = typed.TYPED_FORMAT_VERSION if typed.present(tree) or extra else BASE_FORMAT_VERSION
        if any(r[5] in ENGINE2_CODECS for e in out for r in e["chunks"]):
            version = ENGINE2_FORMAT_VERSION  # docs/format.md §6.1: older luopan cannot decode these blobs
        doc: dict[str, Any] = {
            "format_version": version,
            "run": run, "step": step, "created": datetime.now(timezone.utc).isoformat(),
            "metrics": encode_metrics(metrics), "metadata": dict(metadata or {}), "environment": environment(),
            "fingerprint": structure_fingerprint(out), "packs": list(packs), "entries": out, "tree": tree,
            "stats": {"logical_bytes": sum(e["nbytes"] for e in out), "chunks": sum(len(e["chunks"]) for e in out),
                      **{k: int((written or {}).get(k, 0)) for k in WRITTEN}},
            **(extra or {}),
        }
        code = code_version()
        if code is not None:
            doc["code"] = code
        checked_inputs = self.check_inputs(inputs)
        if checked_inputs:
            doc["inputs"] = checked_inputs
        data = seal_manifest(doc)
        if len(data) > MAX_MANIFEST_BYTES:
            raise UnsupportedValueError(f"the manifest of run {run!r} step {step} would be {len(data)} bytes, more "
                                        f"than readers accept ({MAX_MANIFEST_BYTES}): use a larger chunk_size")
        if self.config.format_version >= ENGINE2_FORMAT_VERSION:  # docs/format.md §4: a zstd frame of it
            data = compress_json(data)
        key = manifest_key(run, step)
        parsed = parse_manifest(data, key, run, step)  # what readers will check, before it is visible
        with locked(self.store, "shared", f"commit of {run} step {step}", timeout=self.lock_timeout,
                    where=self.where):
            # A part may reuse a chunk of a pack that was unreferenced then; a gc between that part and this commit
            # could have swept it. Under this lock no gc runs: every pack is checked here, and live once committed.
            gone = [p for p in packs if not self.store.exists(pack_key(p))]
            if gone:
                raise MissingPackError(f"run {run!r} step {step} was not committed: pack {gone[0][:16]}… that a part "
                                       "reused was removed meanwhile (by gc); save again")
            try:
                if overwrite:
                    self.store.put(key, data)
                elif not self.store.put_if_absent(key, data):
                    raise CheckpointExistsError(f"run {run!r} already has a checkpoint at step {step}; pass "
                                                "overwrite=True to replace it")
            except OSError:
                if not overwrite:  # maybe visible but not durable: a save that raises leaves no checkpoint
                    try:
                        if self.store.get(key) == data:
                            self.store.delete(key)
                    except OSError:
                        pass
                raise
        try:
            self.store.put(latest_ref_key(run), build_ref(run, step, sealed_checksum(data)))
        except OSError as exc:
            warnings.warn(f"checkpoint {run!r} step {step} is committed, but its latest ref could not be updated "
                          f"({exc})", stacklevel=2)
        if self.tier is not None:
            self.tier.committed(CHECKPOINTS, run, step)
        return CheckpointInfo.from_manifest(parsed, key)

"""Checkpoints written in parts (docs/format.md §10.5): several processes each store the chunks of their own tensors
(``store_entries``: packs, then an index file, durable before it returns), and one process commits the manifest that
lists them all (``commit_entries``) — only after every part is durable. Until then nothing is visible; a part whose
process died leaves only unreferenced packs for gc. luopan.dcp builds on this."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ... import typed
from ...errors import CheckpointExistsError, MissingPackError, UnsupportedValueError
from ...format import BASE_FORMAT_VERSION, ENGINE2_FORMAT_VERSION
from ...format.chunking import chunk_spans
from ...format.manifest import encode_metrics, parse_manifest, structure_fingerprint
from ...format.names import check_run, check_step, manifest_key, pack_key
from ...format.pack import ENGINE2_CODECS
from ...repository.chunkwriter import ChunkWriter, stored_plainly
from ...tree import flatten
from ..commit import seal_checkpoint, write_latest_ref
from ..environment import code_version, environment
from ..info import CheckpointInfo
from ..kind import CHECKPOINTS
from ..saving import Saving, refuse_pinned


WRITTEN = ("new_chunks", "new_bytes", "stored_bytes", "new_packs")  # what each part wrote, summed into the stats


@dataclass
class StoredEntries:
    """What ``store_entries`` stored: manifest entries (rows naming packs by id), what it wrote (WRITTEN) and the
    index file naming its new packs (None: it wrote none)."""

    entries: list[dict[str, Any]]
    written: dict[str, int] = field(default_factory=dict)
    index_key: str | None = None

    @property
    def packs(self) -> list[str]:
        """The ids of every pack the entries name (new or reused), once each."""
        return list(dict.fromkeys(r[1] for e in self.entries for r in e["chunks"]))


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
        with self.transaction(CHECKPOINTS, "", None, what="a part of a checkpoint") as tx:
            return self._store_part(tx.chunks(targets=len(leaves)), leaves)

    def _store_part(self, chunks: ChunkWriter, leaves: list[Any]) -> StoredEntries:
        entries = []
        previous = self._parts_rows
        self._parts_saves += 1
        coding = self.config.compression.codec != "none"
        for i, leaf in enumerate(leaves):
            chunks.itemsizes[i] = leaf.itemsize
            # as repo.save: an entry the codec did not pay for last time is stored raw without sampling each chunk
            # again (~0.1 ms a chunk: 5 of a 2-rank DCP re-save's ~50 ms), rechecked about one save in 16
            if coding and stored_plainly(self._parts_entries.get(leaf.path), leaf.path, self._parts_saves):
                chunks.plain.add(i)

        def items() -> Any:
            for i, leaf in enumerate(leaves):
                data = leaf.host_bytes()
                mode, spans = chunk_spans(leaf.nbytes, leaf.shape, self.config.chunk_size)
                entries.append({"path": leaf.path, "kind": leaf.kind, "dtype": leaf.dtype, "shape": list(leaf.shape),
                                "nbytes": leaf.nbytes, "chunking": mode})
                prev = previous.get(leaf.path, [])
                for k, (off, length) in enumerate(spans):
                    # docs/format.md §5.1: a chunk whose XXH3-128 and size equal this process's previous part at the
                    # same place keeps that BLAKE3 address (rows this process computed itself, never read from disk)
                    yield i, data[off : off + length], prev[k] if k < len(prev) else None, None, None

        chunks.write(items())
        index = chunks.write_index()
        for leaf, entry_rows in zip(leaves, chunks.rows):
            self._parts_rows[leaf.path] = entry_rows
        for e, entry_rows in zip(entries, chunks.rows):
            e["chunks"] = []
            for h, size, x in entry_rows:
                loc = chunks.location(h)
                e["chunks"].append([h, loc.pack, loc.offset, loc.length, size, loc.codec, x])
            self._parts_entries[e["path"]] = e
        return StoredEntries(entries, {"new_chunks": chunks.new_chunks, "new_bytes": chunks.new_bytes,
                                       "stored_bytes": chunks.stored_bytes, "new_packs": chunks.new_packs},
                             index)

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
        raw, data = seal_checkpoint(doc, run, step, self.config.format_version >= ENGINE2_FORMAT_VERSION)
        key = manifest_key(run, step)
        parsed = parse_manifest(data, key, run, step)  # what readers will check, before it is visible
        with self.transaction(CHECKPOINTS, run, step, what=f"commit of {run} step {step}") as tx:
            # A part may reuse a chunk of a pack that was unreferenced then; a gc between that part and this commit
            # could have swept it. Under this lock no gc runs: every pack is checked here, and live once committed.
            gone = [p for p in packs if not self.store.exists(pack_key(p))]
            if gone:
                raise MissingPackError(f"run {run!r} step {step} was not committed: pack {gone[0][:16]}… that a part "
                                       "reused was removed meanwhile (by gc); save again")
            if not tx.put_manifest(data, overwrite=overwrite):
                raise CheckpointExistsError(f"run {run!r} already has a checkpoint at step {step}; pass "
                                            "overwrite=True to replace it")
            write_latest_ref(self.store, run, step, raw, stacklevel=3)  # names commit_entries' caller
        return CheckpointInfo.from_manifest(parsed, key)

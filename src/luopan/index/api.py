"""Vector-index snapshots (FAISS) in a luopan repository (docs/format.md §17).

    idx = luopan.index.IndexStore(repo, "kb-main")
    v = idx.snapshot(index, ids=ids, params={"nlist": 1024}, metadata={"model": "e5"})   # 1, 2, ...
    index = idx.load()                     # the live version, with the ops logged since it became live
    idx.rollback(v - 1)                    # the live version moves back atomically
    idx.log_add(ids, vectors); idx.log_remove(ids)
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import warnings
from datetime import datetime, timezone
from typing import Any

import numpy as np

from ..errors import (
    ArgumentTypeError,
    CleanupWarning,
    LuopanError,
    ManifestNotFoundError,
    MissingDependencyError,
    UsageError,
)
from ..format import ROWMAP_FORMAT_VERSION
from ..format.canonical import canonical, sealed_checksum
from ..format.limits import MAX_MANIFEST_BYTES, MAX_SMALL_BYTES
from ..format.names import check_step
from ..repository.core import repository_of
from ..repository.locks import locked
from ..repository.pins import add_pin, read_pins, remove_pin
from ..repository.verify import raise_problems, verify_manifests
from ..retention import Checkpoint, KeepLast, parse_time, plan
from ..store.base import KeyNotFound
from .extents import write_arrays
from .kind import INDEX_KIND, check_index, current_ref_key, index_manifest_key
from .loading import build, read_array
from .manifest import (
    IDS,
    INDEX_FORMAT_VERSION,
    SKELETON,
    build_current,
    parse_current,
    parse_index_manifest,
    seal_index_manifest,
)
from .oplog import OpLog, apply, check_ids, check_vectors, encode
from .tables import Previous, plan_table, split

EXTENT_CHUNK_MAX = 4 << 20  # extents are cut at the repository's chunk size, at most this


def _codec() -> Any:
    """The faiss half of this package, imported on first use (faiss is an optional dependency)."""
    try:
        faiss_codec = importlib.import_module(f"{__package__}.faiss_codec")
    except ImportError as exc:
        raise MissingDependencyError(f"luopan.index needs faiss ({exc}): pip install faiss-cpu (or luopan[faiss])"
                                     ) from None
    return faiss_codec


def _version(version: object) -> int:
    value = check_step(version)
    if value == 0:
        raise UsageError("index versions count from 1")
    return value


def _json_object(what: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a dict of JSON values, got {type(value).__name__}")
    try:
        return json.loads(canonical(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UsageError(f"{what} must hold only JSON values (str, finite numbers, bool, None, lists, dicts with str "
                         f"keys): {exc}") from None


class IndexStore:
    """The snapshots of one named vector index in a repository: ``luopan.index.IndexStore(repo, "kb-main")``.

    Snapshots are incremental: arrays that grew by appending (flat codes, ids, each IVF list) store only their new
    tail; after ``remove_ids`` a version stores the rows added and which stored rows are live (a row map,
    docs/format.md §17.7), not a full copy. The live version is what ``refs/indexes/<name>/current.json`` names (moved by ``snapshot`` and
    ``rollback``, atomically). Supported without copies: IndexFlat (L2, IP), IndexIVFFlat, IndexIVFPQ,
    IndexIVFScalarQuantizer, IndexHNSWFlat, and those inside IndexIDMap/IndexIDMap2; any other faiss index is stored
    as ``faiss.serialize_index`` bytes (works, but consecutive snapshots share nothing). Not thread-safe; the index
    must not change while ``snapshot`` runs.
    """

    def __init__(self, repo: Any, name: str, *, fsync: str = "always") -> None:
        try:
            repo = repository_of(repo)  # composed with the core (a luopan.Repo gives its Repository)
        except TypeError:
            raise ArgumentTypeError(f"IndexStore takes an open repository, not a {type(repo).__name__}: "
                                    "IndexStore(luopan.open(path), name), or repo.index(name)") from None
        self.repo = repo
        self.name = check_index(name)
        self._oplog = OpLog(repo, self.name, fsync)

    def __repr__(self) -> str:
        return f"<luopan.index.IndexStore {self.name!r} in {self.repo.where}>"

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the op log (if this object opened it for writing)."""
        self._oplog.close()

    # -- versions and the live one -----------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Committed version numbers, ascending."""
        return INDEX_KIND.scan(self.repo.store, self.name, False).steps.get(self.name, [])

    def _ref(self) -> dict[str, Any] | None:
        key = current_ref_key(self.name)
        try:
            data = self.repo.store.get_limited(key, MAX_SMALL_BYTES)
        except KeyNotFound:
            return None
        return parse_current(data, key, self.name)

    def current(self) -> int | None:
        """The live version (what ``load()`` returns); None when there is no snapshot. Without a current ref (a
        replica, or a first snapshot cut short before its ref), the latest version is live."""
        ref = self._ref()
        if ref is not None:
            return ref["version"]
        versions = self.versions()
        return versions[-1] if versions else None

    def _missing(self, version: int | None = None) -> ManifestNotFoundError:
        versions = self.versions()
        if not versions:
            return ManifestNotFoundError(f"index {self.name!r} has no snapshot yet: call snapshot(index) first")
        return ManifestNotFoundError(f"index {self.name!r} has no version {version}; versions: "
                                     f"{', '.join(map(str, versions[-10:]))}")

    def manifest(self, version: int | None = None) -> dict[str, Any]:
        """The parsed, verified manifest of a version (the live one when None)."""
        if version is None:
            version = self.current()
            if version is None:
                raise self._missing()
        version = _version(version)
        key = index_manifest_key(self.name, version)
        try:
            data = self.repo.store.get_limited(key, MAX_MANIFEST_BYTES)
        except KeyNotFound:
            raise self._missing(version) from None
        return parse_index_manifest(data, key, self.name, version)

    def info(self, version: int | None = None) -> dict[str, Any]:
        """A version's summary: version, created, index_type, dim, ntotal, params, metadata and stats."""
        doc = self.manifest(version)
        return {k: doc[k] for k in ("version", "created", "index_type", "layout", "dim", "ntotal", "params",
                                    "metadata", "stats")}

    def rollback(self, version: int) -> None:
        """Make ``version`` live (atomically); ops logged against other versions are not replayed on it."""
        version = _version(version)
        self.repo.drain()
        with locked(self.repo.store, "shared", f"rollback of index {self.name}", timeout=self.repo.lock_timeout,
                    where=self.repo.where):
            self.manifest(version)  # exists and is intact
            ref = self._ref()
            if ref is not None and ref["version"] == version:
                return  # already live: its ops logged since it became live stay (they are not a rollback's to drop)
            self._set_current(version)

    def _set_current(self, version: int) -> None:
        self.repo.store.put(current_ref_key(self.name), build_current(self.name, version, self._oplog.next_seq()))

    # -- writing ----------------------------------------------------------------------------------------------------
    def snapshot(self, index: Any, *, ids: Any = None, params: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None) -> int:
        """Store ``index`` as the next version and make it live; returns the version number.

        ``ids``: the external ids of the vectors in the order they were added (kept as an array; an IDMap's own id
        map is used when omitted, and must equal them when given). ``params`` (e.g. ``{"nlist": 1024}``) and
        ``metadata`` are JSON objects kept in the manifest."""
        fc = _codec()
        if not fc.is_faiss_index(index):
            raise UsageError(f"snapshot() takes a faiss index (faiss.Index), got {type(index).__name__}")
        params_doc, meta_doc = _json_object("params", params), _json_object("metadata", metadata)
        repo = self.repo
        repo.drain()
        parts = fc.decompose(index)
        arrays: list[tuple[str, Any, str, list[int]]] = [(p, a, a.dtype.name, list(a.shape)) for p, a in parts.arrays]
        own = fc.id_map(index)
        if ids is not None:
            ids_arr = check_ids(ids)
            if len(ids_arr) != index.ntotal:
                raise UsageError(f"ids has {len(ids_arr)} entries, the index holds {index.ntotal} vectors: pass one "
                                 "id per vector, in the order they were added")
            if own is not None:
                if not np.array_equal(own, ids_arr):
                    raise UsageError("ids differ from the IndexIDMap's own ids: omit ids= for an IDMap index")
            else:
                arrays.append((IDS, ids_arr, "int64", [len(ids_arr)]))
        previous = self._previous()
        if parts.layout == "parts":
            arrays.insert(0, (SKELETON, np.frombuffer(parts.skeleton, dtype=np.uint8), "uint8", [len(parts.skeleton)]))
        arrays, tables = split(arrays, parts.ivfs)
        live = sum(math.prod(shape) * np.dtype(dtype).itemsize for _p, _a, dtype, shape in arrays) + \
            sum(t.rows * sum(c.width for c in t.columns) for t in tables)
        estimate = max(0, live - (previous["stats"]["logical_bytes"] if previous else 0)) + (1 << 20)
        chunk = min(repo.config.chunk_size, EXTENT_CHUNK_MAX)
        prev = Previous(previous, repo.store, INDEX_KIND.label(self.name, previous["version"]) if previous else "")
        with repo.transaction(INDEX_KIND, self.name, None, what=f"snapshot of index {self.name}", estimate=estimate,
                              purpose=f"snapshot index {self.name!r}", format_version=INDEX_FORMAT_VERSION) as tx:
            chunks = tx.chunks(crash_label="index.chunk.written", copy_raw=True)
            reuse = {**prev.entries}
            rowmaps = []
            for t in tables:
                planned = plan_table(t, prev, chunks.reusable, chunk,
                                     repo.config.format_version >= ROWMAP_FORMAT_VERSION)
                arrays += planned.arrays
                reuse.update(planned.previous)
                if planned.rowmap is not None:
                    rowmaps.append(planned.rowmap)
            logical = sum(math.prod(shape) * np.dtype(dtype).itemsize for _p, _a, dtype, shape in arrays)
            written = write_arrays(chunks, arrays, reuse, chunk)
            doc: dict[str, Any] = {
                "format_version": ROWMAP_FORMAT_VERSION if rowmaps else INDEX_FORMAT_VERSION, "kind": "index",
                "name": self.name, "version": 0,
                "created": datetime.now(timezone.utc).isoformat(), "layout": parts.layout,
                "index_type": parts.index_type, "dim": int(index.d), "ntotal": int(index.ntotal),
                "fields": parts.fields, "params": params_doc, "metadata": meta_doc,
                "packs": written.packs, "entries": written.entries,
                "stats": {"logical_bytes": logical, "stored_bytes": written.stored_bytes,
                          "new_bytes": written.new_bytes, "chunks": written.chunks,
                          "new_chunks": written.new_chunks, "new_packs": written.new_packs},
            }
            if rowmaps:
                doc["rowmaps"] = rowmaps
            version, data = tx.put_next(lambda n: self._seal(doc, n), (self.versions() or [0])[-1] + 1,
                                        "snapshot again")
            self.last_manifest_checksum = sealed_checksum(data)
            log_start = self._oplog.next_seq()
            self._set_current(version)
            try:  # the snapshot is live: trimming the ops it holds is cleanup, never a failed snapshot
                self._oplog.drop_before(log_start)
            except OSError as exc:
                msg = (f"index {self.name!r} version {version} is committed and live, but its op log could not be "
                       f"trimmed ({exc}); the ops it holds are not replayed on it, and the next snapshot trims them")
                logging.getLogger("luopan").warning("%s", msg)
                warnings.warn(msg, CleanupWarning, stacklevel=2)
        return version

    def _previous(self) -> dict[str, Any] | None:
        """The manifest new chunks are shared with: the live version's (or None when unreadable)."""
        try:
            version = self.current()
            return None if version is None else self.manifest(version)
        except LuopanError:
            return None

    def _seal(self, doc: dict[str, Any], version: int) -> bytes:
        doc["version"] = version
        data = seal_index_manifest(doc)
        if len(data) > MAX_MANIFEST_BYTES:
            raise UsageError(f"the manifest of index {self.name!r} would exceed {MAX_MANIFEST_BYTES} bytes")
        return data

    # -- reading ----------------------------------------------------------------------------------------------------
    def load(self, version: int | None = None) -> Any:
        """A faiss index equal to the one snapshotted (same search results). ``version=None``: the live version,
        with the ops logged against it since it became live replayed in order. Every chunk is verified."""
        fc = _codec()
        ref = self._ref() if version is None else None  # read once: the version and its log start go together
        doc = self.manifest(ref["version"] if ref is not None else version)
        key = index_manifest_key(self.name, doc["version"])
        index = build(self.repo.store, fc, doc, key, INDEX_KIND.label(self.name, doc["version"]))
        if version is None:
            for op in self._oplog.ops(doc["version"], ref["log_start"] if ref is not None else 0):
                apply(fc, index, op)
        return index

    def ids(self, version: int | None = None) -> np.ndarray | None:
        """The external ids stored with a version (``ids=`` of snapshot, or an IDMap's id map); None if neither."""
        doc = self.manifest(version)
        owner = INDEX_KIND.label(self.name, doc["version"])
        found = read_array(self.repo.store, doc, IDS, owner)
        return found if found is not None else read_array(self.repo.store, doc, "id_map", owner)

    # -- the op log ---------------------------------------------------------------------------------------------------
    def _live_doc(self, what: str) -> dict[str, Any]:
        if self.current() is None:
            raise UsageError(f"index {self.name!r} has no snapshot: snapshot(index) before {what}")
        return self.manifest()

    def log_add(self, ids: Any, vectors: Any) -> int:
        """Log adding ``vectors`` (n x dim floats) with ``ids`` against the live version; ``load()`` replays it
        (``add_with_ids`` on IVF and IDMap indexes, ``add`` on flat and HNSW ones). Returns the record's seq."""
        doc = self._live_doc("log_add")
        arr = check_vectors(vectors, doc["dim"])
        id_arr = check_ids(ids)
        if len(id_arr) != len(arr):
            raise UsageError(f"log_add got {len(id_arr)} ids for {len(arr)} vectors: pass one id per vector")
        return self._oplog.append(encode("add", doc["version"], id_arr, arr), self._log_floor())

    def log_remove(self, ids: Any) -> int:
        """Log removing ``ids`` against the live version (``remove_ids`` on load). Returns the record's seq."""
        doc = self._live_doc("log_remove")
        if "HNSW" in doc["index_type"]:
            raise UsageError(f"a {doc['index_type']} cannot remove vectors (faiss HNSW has no remove_ids): rebuild "
                             "the index and snapshot it instead")
        return self._oplog.append(encode("remove", doc["version"], check_ids(ids), None), self._log_floor())

    def _log_floor(self) -> int:
        ref = self._ref()
        return 0 if ref is None else int(ref["log_start"])

    # -- pins, pruning, verification ----------------------------------------------------------------------------------
    def pin(self, version: int, tag: str | None = None) -> None:
        """Protect ``version`` from pruning."""
        add_pin(self.repo, INDEX_KIND, self.name, _version(version), tag, ManifestNotFoundError)

    def unpin(self, version: int) -> bool:
        return remove_pin(self.repo.store, INDEX_KIND, self.name, _version(version))

    def pins(self) -> dict[int, dict[str, Any]]:
        return read_pins(self.repo.store, INDEX_KIND, self.name)

    def prune(self, keep_last: int = 5) -> list[int]:
        """Delete the manifests of all but the ``keep_last`` newest versions, never the live one nor pinned ones
        (their chunks are freed by ``repo.gc()``). Returns the versions removed."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise UsageError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        repo = self.repo
        repo.drain()
        with locked(repo.store, "exclusive", f"prune of index {self.name}", timeout=repo.lock_timeout,
                    where=repo.where):
            versions = self.versions()
            if not versions:
                return []
            live, pins = self.current(), read_pins(repo.store, INDEX_KIND, self.name)
            items = [Checkpoint(v, parse_time(self.manifest(v)["created"]), {}, v in pins or v == live, ())
                     for v in versions]
            decided = plan(items, KeepLast(keep_last))
            for v in decided.remove:
                repo.store.delete(index_manifest_key(self.name, v))
        return list(decided.remove)

    def verify(self, version: int | None = None) -> int:
        """Read and check every chunk of one version (all when None); returns the bytes checked. IntegrityError
        (``.problems``) names every damaged chunk."""
        numbers = [_version(version)] if version is not None else self.versions()
        if not numbers or not set(numbers) <= set(self.versions()):
            raise self._missing(version)
        checked = verify_manifests(self.repo.store, self.repo.read_manifest,
                                   [(INDEX_KIND, self.name, n) for n in numbers])
        self.repo.forget_damaged(checked.chunk_problems)
        raise_problems(checked.problems, checked)
        return checked.bytes

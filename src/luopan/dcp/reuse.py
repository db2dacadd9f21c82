"""Tier-1 change detection for ``luopan.dcp.Writer(trust_versions=True)`` (docs/format.md §5.1, as ``repo.save``).

For each tensor item a rank writes, the writer records the tensor's storage (weakly), version counter, address,
layout, dtype and device, with the manifest entry it stored for the item. At the next save of the same run into the
same repository by this process, an item whose record is unchanged reuses that entry's chunk rows without reading a
byte — provided every pack they name is still there, intact and long enough (PackChecker); otherwise it is hashed
again. ``commit_entries`` rechecks under its lock that every pack a manifest names exists, so a gc between this check
and the commit fails the save (nothing is committed) rather than committing a manifest naming a missing pack.

What is relied on (checked by tests/test_dcp.py): DCP's default planner hands ``write_data`` the state dict's own
tensor (``resolve_data`` returns ``state_dict[fqn]``, or a DTensor's local tensor, which shares its storage and version
counter), not a copy; ``module.state_dict()`` returns ``detach()``-ed parameters, which share the parameters' version
counters. A planner that hands copies just gets no reuse.

Not relied on, refused instead: copies whose storage is refreshed in place. ``dcp.async_save`` stages the state into
CPU copies, and a stager passed to several saves refreshes the same storages with storage-level copies that never move
a version counter — every record would look unchanged while the values changed. So reuse happens only when the write
runs on the main thread (``async_save`` writes from a background thread) and the storage is neither pinned nor shared
(the marks of DCP's staging buffers); and a reused chunk must still be in the repository's chunk index, which forgets
the chunks ``verify`` found damaged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from ..checkpoint import same_version
from ..format.pack import BlobLocation
from ..repository.packwriter import PackChecker

# (repository location, run) -> item path -> (version record, manifest entry stored for it)
_RECORDS: dict[tuple[str, str], dict[str, tuple[tuple[Any, ...], dict[str, Any]]]] = {}
_LOCK = threading.Lock()


def version_record(t: Any) -> tuple[Any, ...] | None:
    """The record of one tensor as ``request.tensor_versions`` makes it, or None when it has none (no elements, an
    inference-mode tensor without a version counter, a storage that takes no weak reference)."""
    if t.numel() == 0 or t.is_inference():
        return None
    storage = t.untyped_storage()
    try:
        ref = weakref.ref(storage)
    except TypeError:
        return None
    return (ref, t._version, storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            "cpu" if t.is_cpu else str(t.device), t.is_conj(), t.is_neg())


def _staged(t: Any) -> bool:
    """A tensor in pinned or shared memory: how DCP's staging buffers are made."""
    try:
        storage = t.untyped_storage()
        return bool(storage.is_pinned() or storage.is_shared())
    except (RuntimeError, AttributeError):
        return True


class Reuse:
    """One rank's write of one save: which items keep their previous entry, and the records it leaves."""

    def __init__(self, repo: Any, run: str) -> None:
        self.repo = repo
        self.key = (repo.where, run)
        with _LOCK:
            self.seen = dict(_RECORDS.get(self.key, {}))
        self.records: dict[str, tuple[tuple[Any, ...], dict[str, Any] | None]] = {}
        self.checker: PackChecker | None = None
        self.known: dict[str, Any] | None = None
        self.enabled = threading.current_thread() is threading.main_thread()  # not an async_save's writer thread

    def previous(self, path: str, t: Any) -> dict[str, Any] | None:
        """The entry to reuse for item ``path`` holding tensor ``t`` (a copy), or None: read and store it. Records
        ``t``'s version now, before anything reads its bytes."""
        rec = version_record(t)
        if rec is None:
            return None
        if not self.enabled or _staged(t):
            return None  # records are not kept either: a staged copy's record must never be compared
        self.records[path] = (rec, None)
        old = self.seen.get(path)
        if old is None or not same_version(old[0], rec) or not self._chunks_there(old[1]):
            return None
        self.records[path] = (rec, old[1])
        return {**old[1], "chunks": [list(r) for r in old[1]["chunks"]]}

    def _chunks_there(self, entry: dict[str, Any]) -> bool:
        if self.checker is None:
            self.checker = self.repo.repository.pack_checker()
            self.known = self.repo.repository.chunk_index()
        known = self.known or {}
        for r in entry["chunks"]:
            where = BlobLocation(r[1], r[2], r[3], r[4], r[5])
            if known.get(r[0]) != where or not self.checker.reusable(where):
                return False
        return True

    def stored(self, path: str, entry: dict[str, Any]) -> None:
        """The entry ``store_entries`` just stored for ``path``."""
        if path in self.records:
            self.records[path] = (self.records[path][0], entry)

    def keep(self) -> None:
        """Make this write's records the ones the next save of the run compares with."""
        kept = {path: (rec, entry) for path, (rec, entry) in self.records.items() if entry is not None}
        with _LOCK:
            _RECORDS[self.key] = kept

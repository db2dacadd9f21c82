"""The journal-backed store under `LuopanSaver`: one journal record per operation, the in-memory index, object reads
(verified against their BLAKE3 keys, with a bounded cache), snapshots and automatic compaction.

Automatic compaction (after a delete or prune) never waits for a repository lock: another process's save, prune or
gc is unrelated work an agent must not stall on. When a lock is busy the compaction (or the pruning of older
snapshots after it) is put off and tried again, without waiting either, by a later write — at most once per
``COMPACT_RETRY_SECONDS`` (doubling to ``COMPACT_RETRY_MAX_SECONDS``) while the lock stays busy. The delete itself
is a journal record, durable before any of this starts. An explicit ``compact()`` waits as any repository write
does (the repository's ``lock_timeout``).

Several savers — in several processes, or several objects of one — share the journal (``shared=True``, docs/format.md
§16.2): every call runs in `reading()` or `writing()`, which first applies the records the others appended since this
index last looked (and rebuilds the index from the latest snapshot when another one compacted records it used)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import IntegrityError, LockedError, ManifestNotFoundError, RecordNotFoundError
from ..journal import Journal
from .index import Index
from .records import (
    BLOCK_TYPE,
    FORMAT,
    PUT,
    SNAPSHOT_MAGIC,
    WRITES,
    Typed,
    check_object,
    decode,
    element_keys,
    encode,
    join_list,
)

CACHE_BYTES = 32 << 20
COMPACT_MIN_DEAD_BYTES = 8 << 20
SEGMENT_BYTES = 16 << 20  # smaller than the journal's default, so compaction frees log space sooner
COMPACT_RETRY_SECONDS = 1.0  # a compaction put off by a busy lock is tried again by a write this much later…
COMPACT_RETRY_MAX_SECONDS = 60.0  # …doubling up to this while the lock stays busy


class Store:
    """Shared by a saver and its `with_allowlist` clones. Every public method takes `lock`."""

    def __init__(self, location: Any, *, fsync: str, name: str, compact_min_dead_bytes: int,
                 cache_bytes: int = CACHE_BYTES, **journal_options: Any) -> None:
        self.lock = threading.RLock()
        self.journal = Journal(location, fsync=fsync, name=name, shared=True, **journal_options)
        self.index = Index()
        self.cache: OrderedDict[bytes, Typed] = OrderedDict()
        self.cache_bytes = 0
        self.cache_limit = cache_bytes
        self.compact_min_dead_bytes = compact_min_dead_bytes
        self.journal_bytes = 0  # bytes of the snapshot and the records after it: what the journal holds
        self.closed = False
        self.deferred: str | None = None  # "compact" or "prune": automatic work a busy repository lock put off
        self._retry_at = 0.0
        self._retry_pause = COMPACT_RETRY_SECONDS
        self.applied = 0  # the seq of the first record the index has not applied
        self.generation = 0  # the journal's generation the index was built at
        try:
            with self.journal.reading():
                self._load()
        except BaseException:
            self.journal.close()
            raise

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within: the index has every record any saver appended, and none it uses is compacted away."""
        with self.lock, self.journal.reading():
            self._catch_up()
            yield

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Within: as `reading`, and this store's appends are the journal's only ones."""
        with self.lock, self.journal.writing():
            self._catch_up()
            yield

    def _catch_up(self) -> None:
        if self.journal.generation != self.generation:  # another saver compacted records the index points into
            self._load()
            return
        for seq, raw in self.journal.items(start_seq=self.applied):
            self._apply_raw(seq, raw)

    def _apply_raw(self, seq: int, raw: Any) -> None:
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise IntegrityError(f"langgraph journal record {seq} is not bytes")
        self.index.apply(decode(raw), seq)
        self.journal_bytes += len(raw)
        self.applied = seq + 1

    def _load(self) -> None:
        """Build the index from the latest snapshot and the records after it (under the journal's lock: no segment
        goes meanwhile; a snapshot another saver prunes meanwhile makes it look again)."""
        for attempt in range(5):
            self.index, self.journal_bytes, self.cache, self.cache_bytes = Index(), 0, OrderedDict(), 0
            self.generation = self.journal.generation
            try:
                self._load_once()
                return
            except (ManifestNotFoundError, RecordNotFoundError):
                if attempt == 4:
                    raise

    def _load_once(self) -> None:
        snap = self.journal.latest_snapshot()
        start = self.journal.first_seq
        if snap is not None:
            value = snap.value if isinstance(snap.value, (bytes, bytearray, memoryview)) else None
            if value is None:
                raise IntegrityError("the langgraph journal's snapshot is not bytes")
            self.index.load_snapshot(bytes(value))
            self.journal_bytes += len(value)
            start = max(start, snap.seq)
        self.applied = start
        for seq, raw in self.journal.items(start_seq=start):
            self._apply_raw(seq, raw)

    # -- writing ------------------------------------------------------------------------------------------------
    def have(self, key: bytes) -> bool:
        return key in self.index.objects

    def append(self, rec: list, new_objects: list | None = None) -> None:
        """Write one record durably (per the journal's fsync mode), then apply it to the index."""
        raw = encode(rec)
        seq = self.journal.append(raw)  # in `writing()`: the index has every record before it
        self.journal_bytes += len(raw)
        self.index.apply(rec, seq)
        self.applied = seq + 1
        for key, type_, data in new_objects or ():
            if type_ != BLOCK_TYPE:
                self._cache_put(key, (type_, data))
        if self.deferred is not None and time.monotonic() >= self._retry_at:
            self._compact_without_waiting()

    # -- reading ------------------------------------------------------------------------------------------------
    def read_object(self, key: bytes) -> Typed:
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        loc = self.index.objects.get(key)
        if loc is None:
            raise IntegrityError(f"langgraph journal object {key.hex()} is missing")
        if loc.data is not None:
            return loc.type, loc.data  # type: ignore[return-value]
        rec = decode(self.journal.get(loc.seq))
        objs = rec[6] if rec[0] == WRITES else rec[11] if rec[0] == PUT else None
        if objs is None or loc.idx >= len(objs) or objs[loc.idx][0] != key:
            raise IntegrityError(f"langgraph journal record {loc.seq} does not hold object {key.hex()}")
        _k, type_, data = objs[loc.idx]
        check_object(key, type_, data)
        self._cache_put(key, (type_, data))
        return type_, data

    def _cache_put(self, key: bytes, typed: Typed) -> None:
        if key in self.cache or len(typed[1]) > self.cache_limit // 4:
            return
        self.cache[key] = typed
        self.cache_bytes += len(typed[1])
        while self.cache_bytes > self.cache_limit:
            _k, old = self.cache.popitem(last=False)
            self.cache_bytes -= len(old[1])

    def load_ref(self, ref: Any, loads: Any) -> Any:
        if isinstance(ref, bytes):
            return loads(self.read_object(ref))
        keys = element_keys(ref, self.index.block_data)
        return join_list([self.read_object(k) for k in keys], loads)

    # -- space reclamation --------------------------------------------------------------------------------------
    def after_delete(self) -> None:
        """Compact when the journal's dead bytes exceed both its live bytes and the margin —
        unless a repository lock is busy: then it is put off to a later write (the delete is already durable)."""
        live = self.index.live_bytes()  # dead objects stay known until the snapshot: another saver may name them
        dead = self.journal_bytes - live
        if dead > live and dead > self.compact_min_dead_bytes and self.deferred != "compact":
            self._retry_at = 0.0 if self.deferred is None else self._retry_at  # newly due: try it now
            self.deferred = "compact"
        if self.deferred is not None and time.monotonic() >= self._retry_at:
            self._compact_without_waiting()

    def _compact_without_waiting(self) -> None:
        """Do the deferred automatic compaction if no repository lock is in the way; else put it off again."""
        try:
            with _no_wait(self.journal.repo):
                if self.deferred == "compact":
                    self._snapshot()
                self._drop_old_snapshots()
        except LockedError:
            self._retry_at = time.monotonic() + self._retry_pause
            self._retry_pause = min(self._retry_pause * 2, COMPACT_RETRY_MAX_SECONDS)
        else:
            self._retry_pause = COMPACT_RETRY_SECONDS

    def compact(self) -> int:
        """Snapshot the live state into the journal's repository, drop the log segments it covers and the older
        snapshots (their chunks go at the repository's next ``gc``). Waits for repository locks as writes do."""
        seq = self._snapshot()
        self._drop_old_snapshots()
        return seq

    def _snapshot(self) -> int:
        """Commit a snapshot of the live state and drop the log segments it covers (the older snapshots stay until
        ``_drop_old_snapshots``). A LockedError leaves everything as it was."""
        self.index.sweep()
        objs, recs = self.index.snapshot_records(self.read_object)
        value = encode([SNAPSHOT_MAGIC, FORMAT, objs, recs])
        seq = self.journal.compact(value, upto=self.applied)
        fresh = Index()
        fresh.load_snapshot(value)
        self.index = fresh
        self.journal_bytes = len(value)
        self.deferred = "prune"  # the log no longer holds what the snapshot covers: only the pruning is left
        return seq

    def _drop_old_snapshots(self) -> None:
        self.journal.prune(keep_last=1)
        self.deferred = None

    def stats(self) -> dict[str, int]:
        live = sum(loc.size for loc in self.index.objects.values())
        return {"journal_bytes": self.journal_bytes, "object_bytes": live, "objects": len(self.index.objects),
                "structure_bytes": self.index.structure_bytes(),
                "checkpoints": sum(len(sp.ckpts) for _t, _n, sp in self.index.spaces()),
                "next_seq": self.journal.next_seq, "log_bytes": self.journal.size_bytes}

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.journal.close()


@contextmanager
def _no_wait(repo: Any) -> Iterator[None]:
    """Within: the journal's repository takes a lock only if it is free at once (LockedError otherwise). The saver
    holds its store lock meanwhile, so no other call of this saver uses the repository; a `luopan.Repo` shared
    with other threads is, as documented, not safe for their concurrent writes anyway."""
    old = repo.lock_timeout
    repo.lock_timeout = 0
    try:
        yield
    finally:
        repo.lock_timeout = old

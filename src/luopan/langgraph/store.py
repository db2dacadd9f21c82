"""The journal-backed store under `LuopanSaver`: one journal record per operation, the in-memory index, object reads
(verified against their BLAKE3 keys, with a bounded cache), snapshots and automatic compaction."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ..errors import IntegrityError
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


class Store:
    """Shared by a saver and its `with_allowlist` clones. Every public method takes `lock`."""

    def __init__(self, location: Any, *, fsync: str, name: str, compact_min_dead_bytes: int,
                 cache_bytes: int = CACHE_BYTES, **journal_options: Any) -> None:
        self.lock = threading.RLock()
        self.journal = Journal(location, fsync=fsync, name=name, **journal_options)
        self.index = Index()
        self.cache: OrderedDict[bytes, Typed] = OrderedDict()
        self.cache_bytes = 0
        self.cache_limit = cache_bytes
        self.compact_min_dead_bytes = compact_min_dead_bytes
        self.journal_bytes = 0  # bytes of the snapshot and the records after it: what the journal holds
        self.closed = False
        try:
            self._open()
        except BaseException:
            self.journal.close()
            raise

    def _open(self) -> None:
        snap = self.journal.latest_snapshot()
        start = self.journal.first_seq
        if snap is not None:
            value = snap.value if isinstance(snap.value, (bytes, bytearray, memoryview)) else None
            if value is None:
                raise IntegrityError("the langgraph journal's snapshot is not bytes")
            self.index.load_snapshot(bytes(value))
            self.journal_bytes += len(value)
            start = max(start, snap.seq)
        for seq, raw in self.journal.items(start_seq=start):
            if not isinstance(raw, (bytes, bytearray, memoryview)):
                raise IntegrityError(f"langgraph journal record {seq} is not bytes")
            self.index.apply(decode(raw), seq)
            self.journal_bytes += len(raw)

    # -- writing ------------------------------------------------------------------------------------------------
    def have(self, key: bytes) -> bool:
        return key in self.index.objects

    def append(self, rec: list, new_objects: list | None = None) -> None:
        """Write one record durably (per the journal's fsync mode), then apply it to the index."""
        raw = encode(rec)
        seq = self.journal.append(raw)
        self.journal_bytes += len(raw)
        self.index.apply(rec, seq)
        for key, type_, data in new_objects or ():
            if type_ != BLOCK_TYPE:
                self._cache_put(key, (type_, data))

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
        """Forget dead objects; compact when the journal's dead bytes exceed both its live bytes and the margin."""
        live = self.index.sweep()
        for key in [k for k in self.cache if k not in self.index.objects]:
            self.cache_bytes -= len(self.cache.pop(key)[1])
        dead = self.journal_bytes - live
        if dead > live and dead > self.compact_min_dead_bytes:
            self.compact()

    def compact(self) -> int:
        """Snapshot the live state into the journal's repository, drop the log segments it covers and the older
        snapshots (their chunks go at the repository's next ``gc``)."""
        self.index.sweep()
        objs, recs = self.index.snapshot_records(self.read_object)
        value = encode([SNAPSHOT_MAGIC, FORMAT, objs, recs])
        seq = self.journal.compact(value)
        self.journal.prune(keep_last=1)
        fresh = Index()
        fresh.load_snapshot(value)
        self.index = fresh
        self.journal_bytes = len(value)
        return seq

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

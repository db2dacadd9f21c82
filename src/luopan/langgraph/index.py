"""The saver's in-memory index, rebuilt on open from the journal's latest snapshot plus the records after it.

It holds the structure only: threads -> namespaces -> checkpoints (parent, serialized skeleton and metadata, channel
versions), channel-version -> value references, pending writes, and where each content-addressed object lives (a
journal record, or memory for objects that came from a snapshot and for block objects). Object contents are read back
on demand by the saver. Applying a record is deterministic, so replay rebuilds exactly the state that was acknowledged.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import IntegrityError
from .records import (
    BLOBS,
    BLOCK_TYPE,
    COPY_THREAD,
    DELETE_THREADS,
    DROP,
    FORMAT,
    KEY_BYTES,
    PUT,
    SNAPSHOT_MAGIC,
    WRITES,
    Typed,
    decode,
    ref_keys,
)


class Ckpt:
    """One checkpoint: parent id, (type, bytes) of the checkpoint without values and versions, of the metadata."""

    __slots__ = ("meta", "parent", "run_id", "skel", "versions")

    def __init__(self, parent: str | None, skel: Typed, meta: Typed, run_id: str | None,
                 versions: dict[str, Any]) -> None:
        self.parent, self.skel, self.meta, self.run_id, self.versions = parent, skel, meta, run_id, versions


class Space:
    """One (thread, namespace): its checkpoints by id (and sorted ids), value references by (channel, version),
    pending writes by checkpoint id then (task id, idx) -> (channel, ref, task_path)."""

    __slots__ = ("blobs", "ckpts", "order", "writes")

    def __init__(self) -> None:
        self.ckpts: dict[str, Ckpt] = {}
        self.order: list[str] = []
        self.blobs: dict[tuple[str, Any], Any] = {}
        self.writes: dict[str, dict[tuple[str, int], tuple[str, Any, str]]] = {}

    def add(self, cid: str, ck: Ckpt) -> None:
        if cid not in self.ckpts:
            if not self.order or cid > self.order[-1]:
                self.order.append(cid)
            else:
                bisect.insort(self.order, cid)
        self.ckpts[cid] = ck

    def drop(self, ids: Iterable[str]) -> None:
        gone = {cid for cid in ids if cid in self.ckpts}
        if not gone:
            return
        for cid in gone:
            del self.ckpts[cid]
            self.writes.pop(cid, None)
        self.order = [cid for cid in self.order if cid not in gone]
        needed = {(ch, v) for ck in self.ckpts.values() for ch, v in ck.versions.items()}
        self.blobs = {k: r for k, r in self.blobs.items() if k in needed}

    def copy(self) -> Space:
        out = Space()
        out.ckpts, out.order, out.blobs = dict(self.ckpts), list(self.order), dict(self.blobs)
        out.writes = {cid: dict(w) for cid, w in self.writes.items()}
        return out


class Loc:
    """Where an object lives: record `seq`, position `idx` in its object list; or `data` in memory."""

    __slots__ = ("data", "idx", "seq", "size", "type")

    def __init__(self, seq: int, idx: int, size: int, type_: str | None = None, data: bytes | None = None) -> None:
        self.seq, self.idx, self.size, self.type, self.data = seq, idx, size, type_, data


class Index:
    def __init__(self) -> None:
        self.threads: dict[str, dict[str, Space]] = {}
        self.objects: dict[bytes, Loc] = {}

    # -- lookups ------------------------------------------------------------------------------------------------
    def space(self, thread: str, ns: str) -> Space | None:
        return self.threads.get(thread, {}).get(ns)

    def block_data(self, key: bytes) -> bytes:
        loc = self.objects.get(key)
        if loc is None or loc.data is None:
            raise IntegrityError(f"langgraph journal block object {key.hex()} is missing")
        return loc.data

    def spaces(self) -> Iterator[tuple[str, str, Space]]:
        for thread, nss in self.threads.items():
            for ns, sp in nss.items():
                yield thread, ns, sp

    # -- applying records ---------------------------------------------------------------------------------------
    def _objects(self, seq: int | None, objs: list) -> None:
        for i, (key, type_, data) in enumerate(objs):
            if not (isinstance(key, bytes) and len(key) == KEY_BYTES and isinstance(type_, str)
                    and isinstance(data, bytes)):
                raise TypeError("an object is not [16-byte key, type str, data bytes]")
            in_memory = seq is None or type_ == BLOCK_TYPE
            self.objects[key] = Loc(-1 if seq is None else seq, i, len(data), type_ if in_memory else None,
                                    bytes(data) if in_memory else None)

    def _space(self, thread: str, ns: str) -> Space:
        return self.threads.setdefault(thread, {}).setdefault(ns, Space())

    def apply(self, rec: list, seq: int | None) -> None:
        """Apply one decoded record (`seq` None: it comes from a snapshot, its objects are in memory). A record of
        the wrong shape (not one this code wrote) is an IntegrityError naming it."""
        try:
            self._apply(rec, seq)
        except IntegrityError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            where = "the snapshot" if seq is None else f"record {seq}"
            raise IntegrityError(f"langgraph journal {where} is malformed ({type(exc).__name__}: {exc}); it was not "
                                 "written by luopan.langgraph: restore the journal from a copy") from None

    def _apply(self, rec: list, seq: int | None) -> None:
        op = rec[0]
        if op == PUT:
            _, thread, ns, cid, parent, st, sb, mt, mb, run_id, versions, objs, blobs = rec
            self._objects(seq, objs)
            sp = self._space(thread, ns)
            for ch, ver, ref in blobs:
                sp.blobs[(ch, ver)] = ref
            sp.add(cid, Ckpt(parent, (st, sb), (mt, mb), run_id, versions))
        elif op == WRITES:
            _, thread, ns, cid, task_id, task_path, objs, writes = rec
            self._objects(seq, objs)
            w = self._space(thread, ns).writes.setdefault(cid, {})
            for idx, channel, ref in writes:
                w[(task_id, idx)] = (channel, ref, task_path)
        elif op == DELETE_THREADS:
            for thread in rec[1]:
                self.threads.pop(thread, None)
        elif op == DROP:
            for thread, ns, ids in rec[1]:
                sp = self.space(thread, ns)
                if sp is not None:
                    sp.drop(ids)
                    if not sp.ckpts and not sp.writes:
                        del self.threads[thread][ns]
                        if not self.threads[thread]:
                            del self.threads[thread]
        elif op == COPY_THREAD:
            _, src, dst = rec
            for ns, sp in list(self.threads.get(src, {}).items()):
                target = self._space(dst, ns)
                copied = sp.copy()
                for cid in copied.order:
                    target.add(cid, copied.ckpts[cid])
                target.blobs.update(copied.blobs)
                for cid, w in copied.writes.items():
                    target.writes.setdefault(cid, {}).update(w)
        elif op == BLOBS:
            _, thread, ns, blobs = rec
            sp = self._space(thread, ns)
            for ch, ver, ref in blobs:
                sp.blobs[(ch, ver)] = ref
        else:
            raise IntegrityError(f"unknown langgraph journal record op {op!r}")

    # -- liveness -----------------------------------------------------------------------------------------------
    def live_keys(self) -> set[bytes]:
        live: set[bytes] = set()
        for _t, _n, sp in self.spaces():
            for ref in sp.blobs.values():
                live.update(ref_keys(ref, self.block_data))
            for w in sp.writes.values():
                for _ch, ref, _p in w.values():
                    live.update(ref_keys(ref, self.block_data))
        return live

    def live_bytes(self) -> int:
        """The bytes of the objects still referenced, and of the structure (nothing is forgotten: which objects an
        index holds must follow from the log alone, the same in every process that reads it, §18.5)."""
        live = self.live_keys()
        return sum(loc.size for k, loc in self.objects.items() if k in live) + self.structure_bytes()

    def sweep(self) -> int:
        """Forget objects nothing references any more; returns the bytes of the objects still live."""
        live = self.live_keys()
        self.objects = {k: loc for k, loc in self.objects.items() if k in live}
        return sum(loc.size for loc in self.objects.values()) + self.structure_bytes()

    def structure_bytes(self) -> int:
        n = 0
        for _t, _n, sp in self.spaces():
            n += sum(len(ck.skel[1]) + len(ck.meta[1]) + 64 for ck in sp.ckpts.values())
            n += 40 * len(sp.blobs) + sum(64 * len(w) for w in sp.writes.values())
        return n

    # -- snapshot -----------------------------------------------------------------------------------------------
    def snapshot_records(self, read_object: Any) -> tuple[list, list]:
        """(objects, records) that rebuild this index; `read_object(key)` gives (type, data) of a journal object."""
        objs = []
        for key, loc in self.objects.items():
            type_, data = (loc.type, loc.data) if loc.data is not None else read_object(key)
            objs.append([key, type_, data])
        recs: list = []
        for thread, ns, sp in self.spaces():
            for cid in sp.order:
                ck = sp.ckpts[cid]
                recs.append([PUT, thread, ns, cid, ck.parent, ck.skel[0], ck.skel[1], ck.meta[0], ck.meta[1],
                             ck.run_id, ck.versions, [], []])
            recs.append([BLOBS, thread, ns, [[ch, ver, ref] for (ch, ver), ref in sp.blobs.items()]])
            for cid, w in sp.writes.items():
                by_task: dict[tuple[str, str], list] = {}
                for (task_id, idx), (channel, ref, path) in w.items():
                    by_task.setdefault((task_id, path), []).append([idx, channel, ref])
                for (task_id, path), ws in by_task.items():
                    recs.append([WRITES, thread, ns, cid, task_id, path, [], ws])
        return objs, recs

    def load_snapshot(self, value: bytes) -> None:
        snap = decode(value)
        if len(snap) != 4 or snap[0] != SNAPSHOT_MAGIC or snap[1] != FORMAT:
            raise IntegrityError("the langgraph journal's snapshot is not a luopan langgraph snapshot")
        if not isinstance(snap[2], list) or not isinstance(snap[3], list):
            raise IntegrityError("the langgraph journal's snapshot is malformed (objects or records not arrays)")
        try:
            self._objects(None, snap[2])
        except (ValueError, TypeError) as exc:
            raise IntegrityError(f"the langgraph journal's snapshot is malformed ({exc})") from None
        for rec in snap[3]:
            self.apply(rec, None)

    # -- prune --------------------------------------------------------------------------------------------------
    def prune_plan(self, thread_ids: Iterable[str], keep_last: int, delta_channels: Any) -> list:
        """[[thread, ns, [ids to drop]], ...] keeping the `keep_last` newest checkpoints of each namespace plus what
        they need: for every DeltaChannel of a kept checkpoint (`delta_channels(ckpt)`) without a stored value, the
        ancestors back to the nearest one holding a value (their writes rebuild the channel)."""
        plan = []
        for thread in dict.fromkeys(thread_ids):
            for ns, sp in self.threads.get(thread, {}).items():
                keep = set(sp.order[-keep_last:]) if keep_last > 0 else set()
                for cid in list(keep):
                    ck = sp.ckpts[cid]
                    for ch in delta_channels(ck):
                        cur: Ckpt | None = ck
                        while cur is not None and not self._has_value(sp, cur, ch):
                            parent = cur.parent
                            cur = sp.ckpts.get(parent) if parent is not None else None
                            if cur is not None:
                                keep.add(parent)  # type: ignore[arg-type]
                drop = [cid for cid in sp.order if cid not in keep]
                if drop:
                    plan.append([thread, ns, drop])
        return plan

    @staticmethod
    def _has_value(sp: Space, ck: Ckpt, ch: str) -> bool:
        ver = ck.versions.get(ch)
        return ver is not None and sp.blobs.get((ch, ver)) is not None

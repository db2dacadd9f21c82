"""`LuopanSaver`: a LangGraph checkpoint saver on a luopan journal (docs/format.md §18).

Every `put`, `put_writes`, `delete_thread`, `delete_for_runs`, `copy_thread` and `prune` is one journal record: with
``fsync="always"`` one fdatasync, and once the call returns it survives a crash. A torn tail loses at most the record
being written. Channel values are stored once per content (see `records`).
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from ..errors import UsageError
from .index import Ckpt, Space
from .records import COPY_THREAD, DELETE_THREADS, DROP, PUT, WRITES, ValueEncoder
from .serde import NoPickleSerializer, default_serde
from .store import COMPACT_MIN_DEAD_BYTES, SEGMENT_BYTES, Store

STRATEGIES = ("keep_latest", "delete")


class LuopanSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer whose state lives in a luopan journal (``<repo>/journals/<name>/``).

    ``path_or_url``: a repository location (created if missing) or an open `luopan.Repo`. ``fsync``: ``"always"``
    (a returned call is durable), ``"batch"`` (group commit) or ``"off"``. ``serde``: any LangGraph
    `SerializerProtocol`; the default is `JsonPlusSerializer` without pickle and with a strict msgpack allowlist,
    extended by ``allowed_msgpack_modules``. Pickled payloads are refused either way (`PickledPayloadError`).

    Several processes (and threads, and savers of one process) may use one repository's saver at once, as with
    SqliteSaver: each call first applies what the others appended (docs/format.md §16.2, §18.5), so puts from each
    are visible to all, seqs stay unique, and prune, delete and compaction work while others write.

    The index (threads, checkpoints, versions, references) is kept in memory and rebuilt on open from the journal's
    snapshot plus the records after it; values are read back from the journal when asked for. After a prune or a
    delete, the journal is compacted (a snapshot of the live state is written, the log segments it covers and the
    older snapshots are removed; their chunks go at the repository's next ``gc``) once its dead bytes exceed both
    its live bytes and ``compact_min_dead_bytes``; `compact()` does it on demand. That automatic compaction never
    waits for a repository lock: while another process holds one (a save, prune or gc), it is put off and tried
    again by a later call, and the delete stays applied and durable. An explicit `compact()` waits as repository
    writes do (``lock_timeout``). ``segment_bytes``, ``batch_records`` and ``batch_ms`` are passed to the journal.
    """

    def __init__(self, path_or_url: Any, *, fsync: str = "always", name: str = "langgraph",
                 serde: SerializerProtocol | None = None,
                 allowed_msgpack_modules: Iterable[tuple[str, ...] | type] | None = None,
                 compact_min_dead_bytes: int = COMPACT_MIN_DEAD_BYTES, segment_bytes: int = SEGMENT_BYTES,
                 batch_records: int = 64, batch_ms: float = 10.0) -> None:
        if serde is not None and allowed_msgpack_modules is not None:
            raise UsageError("allowed_msgpack_modules configures the default serializer; pass one or the other")
        super().__init__(serde=NoPickleSerializer(serde if serde is not None else
                                                  default_serde(allowed_msgpack_modules)))
        self._store = Store(path_or_url, fsync=fsync, name=name, compact_min_dead_bytes=compact_min_dead_bytes,
                            segment_bytes=segment_bytes, batch_records=batch_records, batch_ms=batch_ms)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._store.lock:
            self._store.close()

    def __enter__(self) -> LuopanSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LuopanSaver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> LuopanSaver:
        """A shallow clone (same journal and index) whose serializer also allows these msgpack types."""
        serde = self.serde.with_msgpack_allowlist(extra_allowlist) if isinstance(self.serde, NoPickleSerializer) \
            else self.serde
        if serde is self.serde:
            return self
        clone = copy.copy(self)
        clone.serde = serde
        return clone

    def compact(self) -> int:
        """Write a snapshot of the live state and delete the journal segments it covers and the older snapshots;
        returns its seq. Waits for a busy repository lock up to the repository's ``lock_timeout`` (LockedError)."""
        with self._store.writing():
            return self._store.compact()

    def stats(self) -> dict[str, int]:
        """Journal bytes (snapshot + records since), live object bytes, object and checkpoint counts."""
        with self._store.reading():
            return self._store.stats()

    @property
    def journal(self) -> Any:
        """The underlying `luopan.journal.Journal`."""
        return self._store.journal

    def get_next_version(self, current: str | int | None, channel: None) -> str:
        current_v = 0 if current is None else current if isinstance(current, int) else int(current.split(".")[0])
        return f"{current_v + 1:032}.{random.random():016}"

    # -- reading ------------------------------------------------------------------------------------------------
    def _tuple(self, thread: str, ns: str, sp: Space, cid: str) -> CheckpointTuple:
        ck = sp.ckpts[cid]
        loads = self.serde.loads_typed
        values = {}
        for ch, ver in ck.versions.items():
            ref = sp.blobs.get((ch, ver))
            if ref is not None:
                values[ch] = self._store.load_ref(ref, loads)
        checkpoint = {**loads(ck.skel), "channel_versions": dict(ck.versions), "channel_values": values}
        stored = sp.writes.get(cid, {})
        order = sorted(stored, key=lambda k: writes_sort_key(stored[k][2], *k))
        pending = [(k[0], stored[k][0], self._store.load_ref(stored[k][1], loads)) for k in order]
        parent = None
        if ck.parent is not None:
            parent = {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": ck.parent}}
        return CheckpointTuple(
            config={"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": cid}},
            checkpoint=checkpoint,  # type: ignore[arg-type]
            metadata=loads(ck.meta), parent_config=parent, pending_writes=pending)  # type: ignore[arg-type]

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        conf = config["configurable"]
        thread, ns = str(conf["thread_id"]), conf.get("checkpoint_ns", "") or ""
        with self._store.reading():
            sp = self._store.index.space(thread, ns)
            if sp is None or not sp.order:
                return None
            cid = get_checkpoint_id(config) or sp.order[-1]
            if cid not in sp.ckpts:
                return None
            return self._tuple(thread, ns, sp, cid)

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        conf = config["configurable"] if config else {}
        want_ns = conf.get("checkpoint_ns") if config else None
        want_id = get_checkpoint_id(config) if config else None
        before_id = get_checkpoint_id(before) if before else None
        with self._store.reading():
            index = self._store.index
            threads = [str(conf["thread_id"])] if config and conf.get("thread_id") is not None \
                else list(index.threads)
            hits = []
            for thread in threads:
                for ns, sp in index.threads.get(thread, {}).items():
                    if want_ns is not None and ns != want_ns:
                        continue
                    for cid in reversed(sp.order):
                        if (want_id and cid != want_id) or (before_id and cid >= before_id):
                            continue
                        if filter:
                            meta = self.serde.loads_typed(sp.ckpts[cid].meta)
                            if not all(meta.get(k) == v for k, v in filter.items()):
                                continue
                        hits.append((thread, ns, cid))
        if limit is not None:
            hits = hits[:max(limit, 0)]
        for thread, ns, cid in hits:
            with self._store.reading():
                sp = self._store.index.space(thread, ns)
                if sp is None or cid not in sp.ckpts:
                    continue
                tup = self._tuple(thread, ns, sp, cid)
            yield tup

    # -- writing ------------------------------------------------------------------------------------------------
    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        conf = config["configurable"]
        thread, ns = str(conf["thread_id"]), conf.get("checkpoint_ns", "") or ""
        parent = conf.get("checkpoint_id")
        skel = {k: v for k, v in checkpoint.items() if k not in ("channel_values", "channel_versions")}
        values = checkpoint.get("channel_values", {})
        versions = dict(checkpoint.get("channel_versions", {}))
        meta = get_checkpoint_metadata(config, metadata)
        run_id = meta.get("run_id")
        dumps = self.serde.dumps_typed
        with self._store.writing():
            sp = self._store.index.space(thread, ns)
            enc = ValueEncoder(dumps, self._store.have)
            blobs = [[ch, ver, enc.ref(values[ch]) if ch in values else None] for ch, ver in new_versions.items()]
            for ch, value in values.items():  # a value whose version this namespace has never stored
                ver = versions.get(ch)
                if ch not in new_versions and ver is not None and (sp is None or (ch, ver) not in sp.blobs):
                    blobs.append([ch, ver, enc.ref(value)])
            st, sb = dumps(skel)
            mt, mb = dumps(meta)
            rec = [PUT, thread, ns, checkpoint["id"], parent, st, sb, mt, mb,
                   run_id if isinstance(run_id, str) else None, versions, enc.new, blobs]
            self._store.append(rec, enc.new)
        return {"configurable": {"thread_id": thread, "checkpoint_ns": ns, "checkpoint_id": checkpoint["id"]}}

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        conf = config["configurable"]
        thread, ns, cid = str(conf["thread_id"]), conf.get("checkpoint_ns", "") or "", conf["checkpoint_id"]
        with self._store.writing():
            sp = self._store.index.space(thread, ns)
            existing = sp.writes.get(cid, {}) if sp is not None else {}
            enc = ValueEncoder(self.serde.dumps_typed, self._store.have)
            out = []
            for idx, (channel, value) in enumerate(writes):
                widx = WRITES_IDX_MAP.get(channel, idx)
                if widx >= 0 and (task_id, widx) in existing:
                    continue
                out.append([widx, channel, enc.ref(value)])
            if out:
                self._store.append([WRITES, thread, ns, cid, task_id, task_path, enc.new, out], enc.new)

    def delete_thread(self, thread_id: str) -> None:
        with self._store.writing():
            if str(thread_id) in self._store.index.threads:
                self._store.append([DELETE_THREADS, [str(thread_id)]])
                self._store.after_delete()

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        runs = {str(r) for r in run_ids}
        if not runs:
            return
        with self._store.writing():
            plan = []
            for thread, ns, sp in self._store.index.spaces():
                ids = [cid for cid in sp.order if sp.ckpts[cid].run_id in runs]
                if ids:
                    plan.append([thread, ns, ids])
            if plan:
                self._store.append([DROP, plan])
                self._store.after_delete()

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src, dst = str(source_thread_id), str(target_thread_id)
        with self._store.writing():
            if src in self._store.index.threads and src != dst:
                self._store.append([COPY_THREAD, src, dst])

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest",
              keep_last: int | None = None) -> None:
        """Keep the ``keep_last`` newest checkpoints of each namespace of these threads (``strategy="keep_latest"``
        alone keeps 1; ``"delete"`` removes the threads), plus whatever the kept ones still need: the values of
        their channel versions, their pending writes, and for each `DeltaChannel` without a stored value the
        ancestors (with their writes) back to the one holding its last snapshot. Parent links of kept checkpoints
        are left as they were."""
        if strategy not in STRATEGIES:
            raise UsageError(f"unknown prune strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                      or keep_last < 0):
            raise UsageError(f"keep_last must be a non-negative int, not {keep_last!r}")
        if strategy == "delete" and keep_last is not None:
            raise UsageError('prune(strategy="delete") removes every checkpoint; it takes no keep_last')
        threads = [str(t) for t in thread_ids]
        with self._store.writing():
            index = self._store.index
            if strategy == "delete" or keep_last == 0:
                present = [t for t in dict.fromkeys(threads) if t in index.threads]
                rec = [DELETE_THREADS, present] if present else None
            else:
                plan = index.prune_plan(threads, 1 if keep_last is None else keep_last, self._delta_channels)
                rec = [DROP, plan] if plan else None
            if rec is not None:
                self._store.append(rec)
                self._store.after_delete()

    def _delta_channels(self, ck: Ckpt) -> list[str]:
        meta = self.serde.loads_typed(ck.meta)
        counters = meta.get("counters_since_delta_snapshot") if isinstance(meta, dict) else None
        return list(counters) if isinstance(counters, dict) else []

    # -- async: the same calls in a worker thread (fsync must not block the event loop) -------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        items = await asyncio.to_thread(lambda: list(self.list(config, filter=filter, before=before, limit=limit)))
        for item in items:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest",
                     keep_last: int | None = None) -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy, keep_last=keep_last)

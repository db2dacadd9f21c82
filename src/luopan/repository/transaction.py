"""The one write transaction every kind commits through (docs/format.md §10):

    with repository.transaction(kind, series, number, what="save of run-a step 100", estimate=n,
                                format_version=v) as tx:
        chunks = tx.chunks()                  # the chunk writer (luopan.repository.chunkwriter)
        ...                                   # the kind cuts and writes its chunks, then chunks.write_index()
        tx.put_manifest(sealed)               # or tx.put_next(seal, start) for "the next free version"

In order: the space preflight (``estimate`` bytes times the space margin must be free, §10.4), the format bump (a kind
whose manifests an older luopan would not see first makes it refuse the repository, §1), the shared lock (prune and
gc wait, §9.2), commit listeners told a write is running (tiering pauses replication), the chunks, the manifest
(``put_if_absent``; a put that raised is taken back, so a failed write leaves no manifest), and on success the
repository learns the new chunks and every commit listener hears of the commit (tiering queues its replication).
A transaction that fails abandons its chunk writers (their packs are deleted unless an index file names them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import CheckpointExistsError, LuopanError
from ..store.base import retract
from .chunkwriter import ChunkWriter
from .kinds import Kind, Opened
from .locks import locked
from .preflight import refuse

COMMIT_ATTEMPTS = 100  # numbers tried by put_next when other writers commit the same series concurrently


class Writable(Opened, Protocol):
    """What a transaction needs of the open repository (luopan.repository.core.Repository)."""

    space_margin: float
    where: str
    listeners: list[Any]

    def require_format(self, version: int) -> None: ...

    def chunk_writer(self, **options: Any) -> ChunkWriter: ...

    def learned(self, locations: dict[str, Any], index_key: str | None) -> None: ...

    def notify_committed(self, kind: Kind, series: str, number: int | None) -> None: ...


class Transaction:
    """One write of one manifest of ``kind`` (``series``, ``number``; number None: chosen by ``put_next``)."""

    def __init__(self, repository: Writable, kind: Kind, series: str, number: int | None, *, what: str,
                 estimate: int | None = None, purpose: str | None = None, format_version: int | None = None,
                 lock: bool = True) -> None:
        self.repository, self.kind, self.series, self.number = repository, kind, series, number
        self.what, self.estimate, self.format_version, self.lock = what, estimate, format_version, lock
        self.purpose = purpose or what  # how the space preflight names the write ("commit artifact 'ds'")
        self.committed = False  # a manifest was put by this transaction
        self.manifest_key: str | None = None
        self._writers: list[ChunkWriter] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Transaction:
        repo = self.repository
        if self.estimate is not None:
            refuse(repo, repo.space_margin, self.estimate, self.purpose)
        if self.format_version is not None:
            repo.require_format(self.format_version)
        with contextlib.ExitStack() as stack:
            if self.lock:  # a shared lock: writes run side by side, prune/gc wait for them (§9.2)
                stack.enter_context(locked(repo.store, "shared", self.what, timeout=repo.lock_timeout,
                                           where=repo.where))
            for listener in repo.listeners:
                stack.enter_context(listener.saving())
            self._stack = stack.pop_all()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            for writer in self._writers:
                if exc_type is not None or (writer.index_key is None and writer.new_packs):
                    writer.abandon()  # packs no index file names are deleted (the crash rule, once)
                elif not writer.abandoned:
                    self._learn(writer)
        finally:
            self._stack.close()
        if exc_type is None and self.committed:
            self.repository.notify_committed(self.kind, self.series, self.number)

    def _learn(self, writer: ChunkWriter) -> None:
        """Remember the chunks a committed write stored. Only deduplication depends on it, never the commit: the next
        ``chunk_index()`` reads their index file anyway, so a store that cannot list it now fails nothing."""
        try:
            self.repository.learned(writer.new_locations, writer.index_key)
        except (OSError, LuopanError):
            pass

    def chunks(self, *, progress: Callable[[int], Any] | None = None, crash_label: str = "chunk.written",
               copy_raw: bool = False, targets: int = 0, known: dict[str, Any] | None = None) -> ChunkWriter:
        """A chunk writer deduplicating against the repository's chunk index (see ChunkWriter); ``known``: that
        index, when the caller already holds it (saves a listing of the index files)."""
        writer = self.repository.chunk_writer(progress=progress, crash_label=crash_label, copy_raw=copy_raw,
                                              targets=targets, known=known)
        self._writers.append(writer)
        return writer

    def put_manifest(self, data: bytes, *, overwrite: bool = False) -> bool:
        """Commit the sealed manifest ``data`` of ``number``: ``put_if_absent`` (False when another writer committed
        it first: the kind decides what that means), or replace it (``overwrite``). A put that raised is taken back:
        the manifest may be visible but not durable, and a failed write must leave none."""
        assert self.number is not None
        return self._put(self.number, data, overwrite)

    def put_next(self, seal: Callable[[int], bytes], start: int, again: str = "write again") -> tuple[int, bytes]:
        """Commit ``seal(n)`` as the next free number from ``start`` (put_if_absent: one is never overwritten);
        returns (number, data). A number that lives only on another tier is still seen by ``exists``."""
        store, number = self.repository.store, start
        for _ in range(COMMIT_ATTEMPTS):
            while store.exists(self.kind.manifest_key(self.series, number)):
                number += 1
            data = seal(number)
            if self._put(number, data, False):
                return number, data
            number += 1  # another writer committed this number meanwhile
        raise CheckpointExistsError(f"{self.kind.series_noun} {self.series!r}: {COMMIT_ATTEMPTS} versions were "
                                    f"committed by others during this write; {again}")

    def _put(self, number: int, data: bytes, overwrite: bool) -> bool:
        key = self.kind.manifest_key(self.series, number)
        store = self.repository.store
        try:
            if overwrite:
                store.put(key, data)
            elif not store.put_if_absent(key, data):
                return False
        except OSError:
            if not overwrite:
                retract(store, key, data)  # a commit that fails leaves no manifest behind
            raise
        self.number, self.committed, self.manifest_key = number, True, key
        return True

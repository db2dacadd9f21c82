"""An append-only log of records in segment files on a local filesystem (docs/format.md §16): framed with length and
checksum, fsync'd as the durability mode says, rotated at a size limit, and recovered on open by cutting a torn tail
back to the last whole record. Kinds build on it: journals (luopan.journal), index op logs (luopan.index).

Durability modes:
- ``"always"``: ``append`` returns once the record is on disk (one ``fdatasync`` per append / ``append_many``).
- ``"batch"``: group commit. ``append`` returns once the record is written to the file; a sync follows when
  ``batch_records`` records are unsynced or ``batch_ms`` milliseconds after the first unsynced one, whichever comes
  first. A crash (of the machine; a crash of the process alone loses nothing) can lose the records of that window.
- ``"off"``: no sync but at segment rotation; a machine crash can lose any records of the last segment.
"""

from __future__ import annotations

import bisect
import fcntl
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import _files
from ..errors import JournalBusyError, RecordNotFoundError, UsageError
from ..format.records import (
    HEADER_BYTES,
    MAX_RECORD_BYTES,
    SYNC_MARK_NAME,
    frame,
    padded,
    read_frame,
    segment_header,
    segment_name,
    sync_mark,
)
from .walio import _mkdir, _put_mark, _sync, _sync_dir, _truncate, _unlink, _write, io_error
from .walscan import Recovery, Segment, damaged, iter_segment, read_at, read_sync_mark, scan_directory

FSYNC_MODES = ("always", "batch", "off")
LOCK_NAME = "LOCK"
DEFAULT_SEGMENT_BYTES = 64 << 20


def make_dirs(path: str) -> None:
    """Create ``path`` and its missing parents, each synced into its parent before this returns (``_files.make_dirs``,
    through this module's ``_mkdir`` and ``_sync_dir``)."""
    _files.make_dirs(path, mkdir=lambda d: _mkdir(d), sync_dir=lambda d: _sync_dir(d))


_REOPEN = "the log refuses appends until it is reopened: {remedy}, then reopen it"


def check_options(fsync: str, batch_records: int, batch_ms: float, segment_bytes: int) -> None:
    if fsync not in FSYNC_MODES:
        raise UsageError(f"fsync must be one of {', '.join(map(repr, FSYNC_MODES))}, not {fsync!r}")
    if isinstance(batch_records, bool) or not isinstance(batch_records, int) or batch_records < 1:
        raise UsageError(f"batch_records must be an integer >= 1, not {batch_records!r}")
    if isinstance(batch_ms, bool) or not isinstance(batch_ms, (int, float)) or not 0 <= batch_ms <= 3_600_000:
        raise UsageError(f"batch_ms must be a number of milliseconds from 0 to 3600000, not {batch_ms!r}")
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 4096:
        raise UsageError(f"segment_bytes must be an integer >= 4096, not {segment_bytes!r}")


class Log:
    """The log in ``directory`` (created when missing; its first record then gets seq ``start_seq``). One writer at a
    time (an exclusive ``flock`` on ``directory/LOCK``); ``read_only=True`` opens without the lock and cuts nothing.
    Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: str = "always", batch_records: int = 64,
                 batch_ms: float = 10.0, segment_bytes: int = DEFAULT_SEGMENT_BYTES, read_only: bool = False,
                 start_seq: int = 0) -> None:
        check_options(fsync, batch_records, batch_ms, segment_bytes)
        self.directory = os.path.abspath(os.fspath(directory))
        self.fsync, self.batch_records, self.batch_ms = fsync, batch_records, float(batch_ms)
        self.segment_bytes, self.read_only = segment_bytes, read_only
        self._mutex = threading.RLock()
        self._flushed = threading.Condition(self._mutex)
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._closed = False
        self._flusher: threading.Thread | None = None
        self._deadline: float | None = None
        self.error: OSError | None = None  # a sync's failure (or a failed undo), raised by every later append
        self._mark_fd: int | None = None
        self._marked = 0  # what the sync mark file says
        if not read_only:
            try:
                make_dirs(self.directory)
            except OSError as exc:
                raise io_error(exc, self.directory, "creating the log directory", "{remedy}, then open the log "
                               "again") from None
            self._take_lock()
        try:
            self.segments, self.recovered = scan_directory(self.directory, cut=not read_only)
            self._next = self.segments[-1].end_seq if self.segments else start_seq
            self._durable = self._next  # what survived a restart is on disk as far as anyone can tell
            if not read_only:
                self._open_tail()
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._release_lock()
            raise

    # -- opening ----------------------------------------------------------------------------------------------------
    def _take_lock(self) -> None:
        self._lock_fd = self._flock_lock(fcntl.LOCK_EX, "open for writing elsewhere (another process, or another "
                                         "object of this one, holds its LOCK): close that one first, or open with "
                                         "read_only=True to read")

    def _flock_lock(self, how: int, busy: str) -> int:
        """The log's LOCK file, open and flocked ``how`` without waiting; JournalBusyError("<dir> is " + busy)."""
        path = os.path.join(self.directory, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise io_error(exc, path, "opening", "{remedy}, then open it again") from None
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalBusyError(f"{self.directory} is {busy}") from None
        return fd

    def _release_lock(self) -> None:
        for fd in (self._mark_fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._mark_fd = self._lock_fd = None

    def _open_tail(self) -> None:
        """Open the last segment for appending, after syncing it: a previous writer may have died with records
        written but not synced, and the first frame of this one vouches (its durable mark) for every record before
        it. Then the sync mark says so too."""
        mark = os.path.join(self.directory, SYNC_MARK_NAME)
        try:
            self._marked = read_sync_mark(self.directory)
            self._mark_fd = os.open(mark, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise io_error(exc, mark, "opening", "{remedy}, then open it again") from None
        if not self.segments:
            self._new_segment(self._next)
            return
        tail = self.segments[-1]
        try:
            self._fd = os.open(tail.path, os.O_WRONLY | os.O_APPEND)
            _sync(self._fd, tail.path)
            _sync_dir(self.directory)
        except OSError as exc:
            raise io_error(exc, tail.path, "syncing the tail of", "{remedy}, then open the log again") from None
        if self._marked > self._next:  # the log was cut back by hand: lower the mark, durably
            self._put_mark(self._next, sync=True)
        self._put_mark(self._next)

    def _put_mark(self, durable: int, sync: bool = False) -> None:
        if self._mark_fd is None or durable == self._marked:
            return
        path = os.path.join(self.directory, SYNC_MARK_NAME)
        try:
            _put_mark(self._mark_fd, sync_mark(durable), path)
            if sync:
                os.fsync(self._mark_fd)
        except OSError as exc:
            if sync:  # a higher mark than the log's end could come back: refuse to vouch for anything
                raise io_error(exc, path, "lowering the sync mark in", "{remedy}, then open the log again") \
                    from None
            return  # the mark is only evidence: a stale one is still true
        self._marked = durable

    def _new_segment(self, first_seq: int) -> None:
        """Start the segment of ``first_seq``: header written and synced, and its name synced into the directory,
        before any record goes in (so no acknowledged record ever lives in a file a crash could lose). On failure
        no trace of it is left (or the log refuses appends until reopened)."""
        path = os.path.join(self.directory, segment_name(first_seq))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as exc:
            raise io_error(exc, path, "creating") from None
        try:
            _write(fd, segment_header(first_seq), path)
            _sync(fd, path)
            _sync_dir(self.directory)
        except OSError as exc:
            os.close(fd)
            err = io_error(exc, path, "starting")
            try:  # a segment file left behind would sit in the middle of the log once appends go on
                _unlink(path)
                _sync_dir(self.directory)
            except OSError:
                self.error = io_error(exc, path, "starting", f"{_REOPEN} (the new segment could not be removed)")
                raise self.error from None
            raise err from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        self.segments.append(Segment(path, first_seq, [], HEADER_BYTES))

    # -- several writers (luopan.repository.walshare.SharedLog overrides these) ------------------------------------
    generation = 0  # how often records this object had indexed were dropped by another writer (SharedLog)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Within: this object's appends are the log's only ones, and it has every record appended so far."""
        with self._mutex:
            yield

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Within: this object has every record appended so far, and none is dropped meanwhile."""
        with self._mutex:
            yield

    # -- writing ----------------------------------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def last_seq(self) -> int:
        """The seq of the last record appended (-1 when none ever was)."""
        return self._next - 1

    @property
    def first_seq(self) -> int:
        """The first seq still readable (records before it were dropped); ``next_seq`` when none is."""
        return self.segments[0].first_seq if self.segments else self._next

    def append(self, payload: bytes | memoryview) -> int:
        """Append one record; returns its seq. Durable on return in ``"always"`` mode."""
        return self.append_many([payload])[0]

    def append_many(self, payloads: Iterable[bytes | memoryview]) -> list[int]:
        """Append records together (one write, one sync in ``"always"`` mode); returns their seqs."""
        items = list(payloads)
        for p in items:
            if not isinstance(p, (bytes, bytearray, memoryview)):
                raise UsageError(f"a log record is bytes, not {type(p).__name__}")
            if len(p) > MAX_RECORD_BYTES:
                raise UsageError(f"a log record holds at most {MAX_RECORD_BYTES} bytes, not {len(p)}")
        with self._mutex:
            self._check_writable()
            total = sum(HEADER_BYTES + padded(len(p)) for p in items)
            tail = self.segments[-1]
            if tail.offsets and tail.size + total > self.segment_bytes:
                self._rotate()  # before any frame: the frames of one call go into one segment
                tail = self.segments[-1]
            size, count, first = tail.size, len(tail.offsets), self._next
            assert self._fd is not None
            try:
                for p in items:
                    data = frame(self._next, self._durable, p)
                    _write(self._fd, data, tail.path)
                    tail.offsets.append(tail.size)
                    tail.size += len(data)
                    self._next += 1
                if self.fsync == "always":
                    self._sync_now()
                elif self.fsync == "batch":
                    self._schedule()
            except OSError as exc:
                self._undo(tail, size, count, first, exc)
            return list(range(first, self._next))

    def _undo(self, tail: Segment, size: int, count: int, first: int, exc: OSError) -> None:
        """After a failed write or sync: cut what this call wrote (the log is as it was before), then raise. A log
        whose sync failed, or that cannot be cut back, refuses appends until reopened."""
        del tail.offsets[count:]
        tail.size, self._next = size, first
        self._durable = min(self._durable, first)
        err = self.error or io_error(exc, tail.path, "appending to")
        try:
            assert self._fd is not None
            _truncate(self._fd, size, tail.path)
        except OSError as again:
            self.error = io_error(again, tail.path, "cutting a failed append from",
                                  f"{_REOPEN} (opening cuts the partial record as a torn tail)")
            raise self.error from None
        raise err from None

    def _check_writable(self) -> None:
        if self.error is not None:
            raise self.error  # a failed sync is never retried and trusted (docs/format.md §10)
        if self._closed:
            raise UsageError(f"the log {self.directory} is closed")
        if self.read_only:
            raise UsageError(f"the log {self.directory} was opened read_only: it cannot be appended to")

    def _rotate(self) -> None:
        """Sync the full segment (in every mode: only the last segment can have a torn tail) and start the next."""
        self._sync_now()
        self._new_segment(self._next)

    def _sync_now(self) -> None:
        if self.error is not None:
            raise self.error
        if self._fd is not None and self._durable < self._next:
            path = self.segments[-1].path
            try:
                _sync(self._fd, path)
            except OSError as exc:  # never retried and trusted: this log refuses to go on (reopen it)
                self.error = io_error(exc, path, "syncing", _REOPEN)
                raise self.error from None
            self._put_mark(self._next)
        self._durable = self._next
        self._deadline = None
        self._flushed.notify_all()

    def sync(self) -> None:
        """Make every record appended so far durable (any mode)."""
        with self._mutex:
            if not self._closed and not self.read_only:
                self._sync_now()

    def _schedule(self) -> None:
        unsynced = self._next - self._durable
        if unsynced >= self.batch_records or self.batch_ms == 0:
            self._sync_now()
            return
        if self._deadline is None:
            self._deadline = time.monotonic() + self.batch_ms / 1000
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="luopan-log-sync", daemon=True)
                self._flusher.start()
            self._flushed.notify_all()

    def _flush_loop(self) -> None:
        with self._mutex:
            while not self._closed:
                if self._deadline is None:
                    self._flushed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._flushed.wait(left)
                    continue
                try:
                    self._sync_now()
                except OSError:  # kept in self.error: the next append or sync raises it
                    self._deadline = None

    # -- reading ----------------------------------------------------------------------------------------------------
    def _locate(self, seq: int) -> tuple[Segment, int]:
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise UsageError(f"a seq is an integer >= 0, not {seq!r}")
        with self._mutex:
            if seq >= self._next:
                raise RecordNotFoundError(f"no record {seq} in {self.directory}: the last one is {self.last_seq}")
            if not self.segments or seq < self.segments[0].first_seq:
                raise RecordNotFoundError(f"record {seq} of {self.directory} was compacted away (the first record "
                                          f"kept is {self.first_seq}): read the snapshot that covers it")
            i = bisect.bisect_right([s.first_seq for s in self.segments], seq) - 1
            seg = self.segments[i]
            return seg, seg.offsets[seq - seg.first_seq]

    def get(self, seq: int) -> bytes:
        """One record's payload, checked against its checksum."""
        seg, off = self._locate(seq)
        i = seq - seg.first_seq
        end = seg.offsets[i + 1] if i + 1 < len(seg.offsets) else seg.size
        data = memoryview(read_at(seg.path, seq, off, end - off))
        fr = read_frame(data, 0, seq)
        if fr is None:
            raise damaged(seg.path, off, seq, "no longer matches its checksum (changed since the log was opened)")
        return bytes(fr.payload)

    def items(self, start_seq: int = 0) -> Iterator[tuple[int, bytes]]:
        """(seq, payload) of every record from ``start_seq`` to the last one appended when called."""
        with self._mutex:
            end = self._next
            if start_seq < self.first_seq and start_seq < end:
                self._locate(start_seq)  # raises: compacted away
            segs = [(s, len(s.offsets)) for s in self.segments if s.end_seq > start_seq and s.first_seq < end]
        for seg, count in segs:
            yield from iter_segment(seg, count, max(start_seq, seg.first_seq), end)

    # -- dropping ---------------------------------------------------------------------------------------------------
    def drop_before(self, seq: int) -> int:
        """Delete the segments whose records all come before ``seq`` (never the one being appended to), oldest
        first, the directory synced after each unlink: unlinks reach the disk in any order otherwise, and a crash
        could keep an older segment and lose a newer one, a gap. So what remains is contiguous in every state a
        crash can leave. Returns the bytes freed."""
        freed = 0
        with self._mutex:
            self._check_writable()
            while len(self.segments) > 1 and self.segments[1].first_seq <= seq:
                seg = self.segments[0]
                try:
                    _unlink(seg.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise io_error(exc, seg.path, "deleting", "{remedy}; compacting again deletes it") from None
                self.segments.pop(0)
                freed += seg.size
                try:
                    _sync_dir(self.directory)
                except OSError as exc:
                    raise io_error(exc, self.directory, "syncing", "{remedy}; compacting again goes on") \
                        from None
        return freed

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    # -- closing ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Sync (unless the mode is ``"off"``) and release the files and the lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            try:
                if not self.read_only and self.fsync != "off":
                    self._sync_now()
            finally:
                self._closed = True
                self._flushed.notify_all()
                if self._fd is not None:
                    fd, self._fd = self._fd, None
                    try:
                        os.close(fd)
                    except OSError as exc:
                        raise io_error(exc, self.segments[-1].path, "closing", _REOPEN) from None
                    finally:
                        self._release_lock()
                self._release_lock()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join()

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Log({self.directory!r}, fsync={self.fsync!r}, records {self.first_seq}..{self.last_seq})"


__all__ = ["Log", "Recovery", "FSYNC_MODES", "check_options"]

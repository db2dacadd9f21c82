"""A log several writers append to at once — processes, or objects of one process (docs/format.md §16.2, "Several
writers"): ``SharedLog``.

Each writer holds a shared ``flock`` on ``LOCK`` for as long as it has the log open (so an exclusive writer, `Log`,
and a shared one exclude each other: `JournalBusyError`), and takes an exclusive ``flock`` on ``APPEND`` around each
append, sync, rotation and segment drop; a reader of the writer's own index takes it shared. Under the lock the writer
first **catches up**: it reads the frames other writers appended after the last record it knows (from that offset of
its last segment to the file's end), follows the segments they started, and forgets the ones they dropped. So seqs
stay unique and contiguous across writers, every frame of a writer is whole before the next one writes, and a frame
that does not check at the end of the log, seen under the exclusive lock, was left by a writer that died mid-append:
a torn tail, cut by the rules of a reopened log (§16.2) before the next record goes in. Under the shared lock a
catch-up only reads (it stops before anything that does not check).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UsageError
from ..format.records import HEADER_BYTES, parse_segment_header, segment_name
from .wal import Log
from .walio import _sync, _sync_dir, io_error
from .walscan import Recovery, Segment, _rewrite_header, _scan, logger, read_sync_mark, scan_directory
from .walscan import _truncate as _cut

APPEND_LOCK_NAME = "APPEND"


class SharedLog(Log):
    """The log in ``directory``, appended to by this object and by any other `SharedLog` on it (in this process or
    another). Options as `Log` (no ``read_only``: open a `Log` read-only to read beside writers). Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], **options: object) -> None:
        self._append_fd: int | None = None
        self._held = 0  # depth of APPEND held by this object (under its mutex)
        self._held_ex = False
        super().__init__(directory, **options)  # type: ignore[arg-type]  # scanned and cut under APPEND
        self._unlock()

    # -- locks ------------------------------------------------------------------------------------------------------
    def _take_lock(self) -> None:
        self._lock_fd = self._flock_lock(fcntl.LOCK_SH, "open for writing by a single writer (a Journal opened "
                                         "without shared=True holds its LOCK): close that one first, or open it "
                                         "with shared=True as well")
        path = os.path.join(self.directory, APPEND_LOCK_NAME)
        try:
            self._append_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise io_error(exc, path, "opening", "{remedy}, then open it again") from None
        fcntl.flock(self._append_fd, fcntl.LOCK_EX)
        self._held, self._held_ex = 1, True

    def _unlock(self) -> None:
        self._held, self._held_ex = 0, False
        if self._append_fd is not None:
            fcntl.flock(self._append_fd, fcntl.LOCK_UN)

    def _release_lock(self) -> None:
        if self._append_fd is not None:
            os.close(self._append_fd)
            self._append_fd = None
        super()._release_lock()

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        with self._mutex:
            if self._held:
                if exclusive and not self._held_ex:
                    raise UsageError("a log's shared (reading) lock cannot be raised to its writing lock: take "
                                     "writing() first")
                self._held += 1
                try:
                    yield
                finally:
                    self._held -= 1
                return
            if self._closed or self._append_fd is None:
                raise UsageError(f"the log {self.directory} is closed")
            fcntl.flock(self._append_fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            self._held, self._held_ex = 1, exclusive
            try:
                self._catch_up(cut=exclusive)
                yield
            finally:
                self._unlock()

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._locked(True):
            yield

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._locked(False):
            yield

    # -- catching up ------------------------------------------------------------------------------------------------
    def _catch_up(self, cut: bool) -> None:
        """Take in what other writers did since this object last looked: segments dropped, records appended,
        segments started. ``cut`` (under the exclusive lock): a torn tail a dead writer left is cut."""
        old_next = self._next
        if self.segments and not os.path.exists(self.segments[0].path):
            while len(self.segments) > 1 and not os.path.exists(self.segments[0].path):
                self.segments.pop(0)  # another writer compacted: the oldest segments went, oldest first
            self.generation += 1
        while self.segments:
            tail = self.segments[-1]
            try:
                size = os.stat(tail.path).st_size
            except FileNotFoundError:  # dropped with every segment this object knew: read the directory again
                self._rescan(cut)
                break
            if size > tail.size:
                if not self._read_more(tail, cut):
                    break  # a torn tail: nothing follows it
                continue
            if size < tail.size:
                self._rescan(cut)  # cut back below what this object had read (by hand): read it again
                break
            nxt = os.path.join(self.directory, segment_name(tail.end_seq))
            if not tail.offsets or not os.path.exists(nxt):  # (an empty segment is never rotated away)
                break
            self._follow(nxt, tail.end_seq, cut)
        if self._next != old_next:
            self._durable = max(min(self._durable, old_next), min(read_sync_mark(self.directory), self._next))

    def _read_more(self, tail: Segment, cut: bool) -> bool:
        """Frames appended to ``tail`` after its known end; False when a torn tail ends it (cut when ``cut``)."""
        base = tail.size
        try:
            with open(tail.path, "rb") as f:
                f.seek(base)
                buf = memoryview(f.read())
        except OSError as exc:
            raise io_error(exc, tail.path, "reading") from None
        if not cut:  # under the shared lock: only whole frames; what does not check is left to the next writer
            probe = Segment(tail.path, tail.first_seq, list(tail.offsets), tail.size)
            torn = _scan(probe, buf, True, 0, base)
            tail.offsets, tail.size = probe.offsets, (probe.size if torn is None else torn[0])
            self._next = tail.end_seq
            return torn is None
        torn = _scan(tail, buf, True, read_sync_mark(self.directory), base)
        self._next = tail.end_seq
        if torn is None:
            return True
        off, reason = torn
        tail.size = off
        _cut(tail.path, off)
        rec = Recovery(tail.path, off, base + len(buf) - off, tail.end_seq, reason, True)
        logger.warning("journal recovery: %s", rec)
        self.recovered.append(rec)
        mark = read_sync_mark(self.directory)
        if mark > self._next:  # it vouched for a record cut short at the end (a copy's): lower it, durably
            self._marked = mark
            self._put_mark(self._next, sync=True)
        return False

    def _follow(self, path: str, first: int, cut: bool) -> None:
        """Take on the segment another writer started after this object's last one (that one was synced whole
        before it was created) and make it the one this object appends to."""
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER_BYTES)
        except OSError as exc:
            raise io_error(exc, path, "reading") from None
        if parse_segment_header(head) != first and cut:  # its starter died while writing the header
            _rewrite_header(path, first)
            rec = Recovery(path, 0, len(head), first, "a segment header cut short or damaged", True)
            logger.warning("journal recovery: %s", rec)
            self.recovered.append(rec)
        self.segments.append(Segment(path, first))
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise io_error(exc, path, "opening") from None
        try:  # its starter may have died before syncing it into the directory: records go in only once it is
            _sync(fd, path)
            _sync_dir(self.directory)
        except OSError as exc:
            os.close(fd)
            raise io_error(exc, path, "syncing the new segment", "{remedy}, then try again") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    def _rescan(self, cut: bool) -> None:
        self.segments, found = scan_directory(self.directory, cut=cut)
        self.recovered.extend(found)
        self.generation += 1
        self._next = self.segments[-1].end_seq if self.segments else self._next
        if not self.segments:
            return
        try:
            fd = os.open(self.segments[-1].path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise io_error(exc, self.segments[-1].path, "opening") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd

    # -- writing, syncing and dropping under the exclusive lock ----------------------------------------------------
    def append_many(self, payloads):  # type: ignore[no-untyped-def]
        with self._locked(True):
            return super().append_many(payloads)

    def _sync_now(self) -> None:
        if self._append_fd is None or self._closed:
            return super()._sync_now()
        with self._locked(True):
            super()._sync_now()

    def start_segment(self, seq: int) -> None:
        """Start a new segment at ``seq`` when it is the next seq and the last segment holds records."""
        with self._locked(True):
            if seq == self._next and self.segments[-1].offsets:
                self._rotate()

    def drop_before(self, seq: int) -> int:
        with self._locked(True):
            return super().drop_before(seq)


__all__ = ["APPEND_LOCK_NAME", "SharedLog"]

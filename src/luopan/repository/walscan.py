"""Opening a log's segments (docs/format.md §16.2): every frame checked, a torn tail of the last segment cut back to
the last whole record, damage anywhere else an error naming the segment and the offset.

The torn-tail rule. A crash can leave what was written after the last sync lost, cut short, garbled, zero-filled or
reaching the disk page by page in any order; what a sync covered is intact. Only the last segment can have a torn
tail (each segment is synced in full before the next one starts). Its first unreadable frame (seq S) starts one when
- nothing readable follows it (the file ends in a cut-short, zero-filled or garbled region), and it is cut short,
  zero-filled from inside it to the end of the file, or the log's sync mark does not vouch for S (a whole record below the mark that does not check was synced and
  acknowledged: its damage is bit rot, not a crash); or
- intact frames follow it, but nothing on disk says S had been synced: no later intact frame's durable mark exceeds
  S, and neither does the log's sync mark (``DURABLE``, rewritten after every sync, never synced itself). Then S and
  what follows were never acknowledged as durable (an acknowledgement comes after the sync and the sync mark), and
  the pages of the unsynced tail reached the disk out of order.
Anything else is damage: an error naming the file and offset, nothing cut. So is a damaged segment header, unless the
segment holds nothing but it (a crash while the segment was being started: it is written and synced before any
record goes in), and any unreadable frame in a segment other than the last.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import CorruptJournalError, RecordNotFoundError
from ..format.records import (
    HEADER_BYTES,
    SYNC_MARK_NAME,
    frames_after,
    parse_segment_header,
    parse_sync_mark,
    padded,
    read_frame,
    segment_header,
    segment_seq,
)
from .walio import io_error

logger = logging.getLogger("luopan")
_RESCANS = 8  # a read-only scan starts again when a writer deletes a segment under it (compaction); this many times


@dataclass
class Segment:
    path: str
    first_seq: int
    offsets: list[int] = field(default_factory=list)  # of each record's frame, in seq order
    size: int = HEADER_BYTES  # bytes of whole records (the file's length once a torn tail is cut)

    @property
    def end_seq(self) -> int:
        return self.first_seq + len(self.offsets)


@dataclass(frozen=True)
class Recovery:
    """What opening a log found after the last whole record of its last segment, and cut (or, read-only, ignored)."""

    segment: str
    offset: int  # where the cut was made: the end of the last whole record
    bytes_cut: int
    next_seq: int  # the seq the next record gets
    reason: str
    cut: bool

    def __str__(self) -> str:
        done = "cut" if self.cut else "ignored (read-only)"
        return (f"{self.segment}: torn tail of {self.bytes_cut} bytes at offset {self.offset} {done} ({self.reason});"
                f" the log continues at record {self.next_seq}")


def damaged(path: str, offset: int, seq: int, why: str) -> CorruptJournalError:
    err = CorruptJournalError(f"journal segment {path} is damaged at offset {offset}: record {seq} {why}. Nothing was "
                              "cut or skipped. Restore the segment from a copy, or, to give up every record from "
                              f"{seq} on, truncate the file to {offset} bytes and remove the segments after it")
    err.segment, err.offset = path, offset
    return err


def gone(path: str, seq: int) -> RecordNotFoundError:
    return RecordNotFoundError(f"record {seq}: its segment {path} was deleted after this log was opened (the writer "
                               "compacted it into a snapshot): reopen the journal, read its latest snapshot, then the "
                               "records from the snapshot's seq")


def read_sync_mark(directory: str) -> int:
    """What the log's sync mark vouches for: every record below it had been synced (0 when there is none or it is
    damaged: a damaged mark proves nothing)."""
    path = os.path.join(directory, SYNC_MARK_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_BYTES + 1)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise io_error(exc, path, "reading") from None
    return parse_sync_mark(data) or 0


def _read(path: str) -> memoryview:
    with open(path, "rb") as f:  # a segment is at most segment_bytes (plus one large record): read whole
        return memoryview(f.read())


def _scan(seg: Segment, buf: memoryview, last: bool, vouched: int, base: int = 0) -> tuple[int, str] | None:
    """Fill ``seg.offsets``; return (offset, reason) of a torn tail of the last segment, or None when clean.
    ``vouched``: the log's sync mark (records below it were synced). ``base``: the file offset ``buf`` starts at
    (0: the whole file; else the end of the records already in ``seg``, for a writer catching up, §16.2)."""
    pos, seq = (HEADER_BYTES if base == 0 else 0), seg.end_seq
    while pos < len(buf):
        f = read_frame(buf, pos, seq)
        if f is None:
            length = int.from_bytes(buf[pos : pos + 4], "little")
            if pos + HEADER_BYTES > len(buf):
                reason = "a record header cut short"
            elif pos + HEADER_BYTES + padded(length) > len(buf):  # its padding too: frames are 8-byte aligned
                reason = "a record cut short"
            elif len(buf[pos:].tobytes().rstrip(b"\0")) < HEADER_BYTES + length:
                reason = "a record whose end is zero-filled"  # zeros from inside it to the end of the file
            else:
                reason = "a record whose checksum does not match"
            if not last:
                raise damaged(seg.path, base + pos, seq, f"is unreadable ({reason}) in a segment that was complete")
            later, intact = frames_after(buf, pos, seq)
            if later is not None:
                raise damaged(seg.path, base + pos, seq, f"is unreadable ({reason}), but record {later.seq} (offset "
                              f"{base + later.offset}) was written after it had been made durable")
            if seq < vouched and (intact is not None or reason.endswith("does not match")):
                # a whole record a sync covered that does not check: bit rot or an overwrite, never a crash's torn
                # tail. (One cut short, or zero-filled from inside it to the end of the file, is still cut: a copy
                # of a live log, made segment by segment, can end mid-record while its sync mark, copied later,
                # vouches for more; a disk whose cache ignored a flush leaves a tail of zeros after a power loss.
                # Neither is what bit rot does.)
                after = (f" although record {intact.seq} (offset {base + intact.offset}) after it is intact, and"
                         if intact is not None else ", but")
                raise damaged(seg.path, base + pos, seq, f"is unreadable ({reason}){after} the log's sync mark "
                              f"({SYNC_MARK_NAME}) says every record below {vouched} had been made durable")
            return base + pos, reason
        seg.offsets.append(base + pos)
        pos += f.size
        seq += 1
    seg.size = base + pos
    return None


def scan_directory(directory: str, *, cut: bool) -> tuple[list[Segment], list[Recovery]]:
    """The segments of a log, checked; a torn tail is truncated (and synced) when ``cut``. Read-only (not ``cut``),
    a segment deleted meanwhile by the writer (compaction) makes the scan start again."""
    for attempt in range(_RESCANS):
        try:
            return _scan_directory(directory, cut)
        except FileNotFoundError as exc:
            if cut or attempt == _RESCANS - 1:
                raise io_error(exc, exc.filename or directory, "reading") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _scan_directory(directory: str, cut: bool) -> tuple[list[Segment], list[Recovery]]:
    try:
        names = sorted(n for n in os.listdir(directory) if segment_seq(n) is not None)
        vouched = read_sync_mark(directory)
    except FileNotFoundError:
        if not cut:
            return [], []  # read-only, before the log's first writer created it: no records yet
        raise
    except OSError as exc:
        raise io_error(exc, directory, "listing") from None
    segments: list[Segment] = []
    recovered: list[Recovery] = []
    for i, name in enumerate(names):
        path = os.path.join(directory, name)
        first = segment_seq(name)
        assert first is not None
        last = i == len(names) - 1
        if segments and segments[-1].end_seq != first:
            raise damaged(segments[-1].path, segments[-1].size, segments[-1].end_seq,
                          f"is missing: the next segment, {name}, starts at record {first}")
        try:
            buf = _read(path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise io_error(exc, path, "reading") from None
        head = parse_segment_header(bytes(buf[:HEADER_BYTES]))
        if head != first:
            if not last or len(buf) > HEADER_BYTES:
                # A header is written and synced before any record goes in: one that is bad while records
                # follow it was damaged after it was made durable.
                raise damaged(path, 0, first, "cannot be found: the segment's header is damaged (the segment holds "
                              f"{len(buf)} bytes)")
            # The last segment's header itself was torn (a crash while the segment was being started): no
            # record was ever written in it, so it starts again empty.
            rec = Recovery(path, 0, len(buf), first, "a segment header cut short or damaged", cut)
            if cut:
                _rewrite_header(path, first)
            recovered.append(rec)
            segments.append(Segment(path, first))
            continue
        seg = Segment(path, first)
        torn = _scan(seg, buf, last, vouched)
        if torn is not None:
            off, reason = torn
            seg.size = off
            recovered.append(Recovery(path, off, len(buf) - off, seg.end_seq, reason, cut))
            if cut:
                _truncate(path, off)
        segments.append(seg)
    for rec in recovered:
        logger.warning("journal recovery: %s", rec)
    return segments, recovered


def _truncate(path: str, size: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise io_error(exc, path, "cutting the torn tail of") from None


def _rewrite_header(path: str, first: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            data = memoryview(segment_header(first))
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise io_error(exc, path, "rewriting the torn header of") from None


def read_at(path: str, seq: int, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` of a segment (fewer at its end); errors name the file."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(size)
    except FileNotFoundError:
        raise gone(path, seq) from None
    except OSError as exc:
        raise io_error(exc, path, "reading") from None


def iter_segment(seg: Segment, count: int, start_seq: int, end_seq: int) -> Iterator[tuple[int, bytes]]:
    """(seq, payload) of the records ``start_seq`` ≤ seq < ``end_seq`` among the first ``count`` of a segment, each
    checked again (a record damaged since the log was opened is an error, not skipped)."""
    first = max(start_seq, seg.first_seq) - seg.first_seq
    last = min(end_seq - seg.first_seq, count)
    if first >= last:
        return
    try:
        f = open(seg.path, "rb", buffering=1 << 20)
    except FileNotFoundError:
        raise gone(seg.path, seg.first_seq + first) from None
    except OSError as exc:
        raise io_error(exc, seg.path, "reading") from None
    with f:
        f.seek(seg.offsets[first])
        for i in range(first, last):  # frames are contiguous: sequential reads
            stop = seg.offsets[i + 1] if i + 1 < len(seg.offsets) else seg.size
            try:
                data = f.read(stop - seg.offsets[i])
            except OSError as exc:
                raise io_error(exc, seg.path, "reading") from None
            fr = read_frame(memoryview(data), 0, seg.first_seq + i)
            if fr is None:
                raise damaged(seg.path, seg.offsets[i], seg.first_seq + i,
                              "no longer matches its checksum (changed since the log was opened)")
            yield seg.first_seq + i, bytes(fr.payload)

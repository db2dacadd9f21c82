"""Opening a log's segments (docs/format.md §16.2): every frame checked, a torn tail of the last segment cut back to
the last whole record, damage anywhere else an error naming the segment and the offset."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import CorruptJournalError
from ..format.records import (
    HEADER_BYTES,
    durable_after,
    parse_segment_header,
    read_frame,
    segment_header,
    segment_seq,
)

logger = logging.getLogger("luopan")


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


def _read(path: str) -> memoryview:
    with open(path, "rb") as f:  # a segment is at most segment_bytes (plus one large record): read whole
        return memoryview(f.read())


def _scan(seg: Segment, buf: memoryview, last: bool) -> tuple[int, str] | None:
    """Fill ``seg.offsets``; return (offset, reason) of a torn tail of the last segment, or None when clean."""
    pos, seq = HEADER_BYTES, seg.first_seq
    while pos < len(buf):
        f = read_frame(buf, pos, seq)
        if f is None:
            if pos + HEADER_BYTES > len(buf):
                reason = "a record header cut short"
            elif int.from_bytes(buf[pos : pos + 4], "little") + HEADER_BYTES + pos > len(buf):
                reason = "a record cut short"
            else:
                reason = "a record whose checksum does not match"
            if not last:
                raise damaged(seg.path, pos, seq, f"is unreadable ({reason}) in a segment that was complete")
            later = durable_after(buf, pos, seq)
            if later is not None:
                raise damaged(seg.path, pos, seq, f"is unreadable ({reason}), but record {later.seq} (offset "
                              f"{later.offset}) was written after it had been made durable")
            return pos, reason
        seg.offsets.append(pos)
        pos += f.size
        seq += 1
    seg.size = pos
    return None


def scan_directory(directory: str, *, cut: bool) -> tuple[list[Segment], list[Recovery]]:
    """The segments of a log, checked; a torn tail is truncated (and synced) when ``cut``."""
    names = sorted(n for n in os.listdir(directory) if segment_seq(n) is not None)
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
        buf = _read(path)
        head = parse_segment_header(bytes(buf[:HEADER_BYTES]))
        if head != first:
            if not last:
                raise damaged(path, 0, first, "cannot be found: the segment's header is damaged")
            # The last segment's header itself was torn (a crash while the segment was being started): no
            # record was ever acknowledged in it, so it starts again empty.
            rec = Recovery(path, 0, len(buf), first, "a segment header cut short or damaged", cut)
            if cut:
                _rewrite_header(path, first)
            recovered.append(rec)
            segments.append(Segment(path, first))
            continue
        seg = Segment(path, first)
        torn = _scan(seg, buf, last)
        if torn is not None:
            off, reason = torn
            seg.size = off
            recovered.append(Recovery(path, off, len(buf) - off, seg.end_seq, reason, cut))
        if torn is not None and cut:
            _truncate(path, off)
        segments.append(seg)
    for rec in recovered:
        logger.warning("journal recovery: %s", rec)
    return segments, recovered


def _truncate(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite_header(path: str, first: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, segment_header(first))
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_segment(seg: Segment, count: int, start_seq: int, end_seq: int) -> Iterator[tuple[int, bytes]]:
    """(seq, payload) of the records ``start_seq`` ≤ seq < ``end_seq`` among the first ``count`` of a segment, each
    checked again (a record damaged since the log was opened is an error, not skipped)."""
    first = max(start_seq, seg.first_seq) - seg.first_seq
    last = min(end_seq - seg.first_seq, count)
    if first >= last:
        return
    with open(seg.path, "rb", buffering=1 << 20) as f:
        f.seek(seg.offsets[first])
        for i in range(first, last):  # frames are contiguous: sequential reads
            stop = seg.offsets[i + 1] if i + 1 < len(seg.offsets) else seg.size
            fr = read_frame(memoryview(f.read(stop - seg.offsets[i])), 0, seg.first_seq + i)
            if fr is None:
                raise damaged(seg.path, seg.offsets[i], seg.first_seq + i,
                              "no longer matches its checksum (changed since the log was opened)")
            yield seg.first_seq + i, bytes(fr.payload)

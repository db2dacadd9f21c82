"""Journal segments and record frames (docs/format.md §16.1): the bytes, nothing about files.

A segment starts with a 32-byte header; records follow as frames, each 8-byte aligned:

    header  magic b"LPJSEG1\\n" | first_seq u64 | reserved u64 (0) | xxh3-64 of the 24 bytes before
    frame   length u32 | flags u32 (0) | seq u64 | durable u64 | xxh3-64 of the 24 bytes before + payload
            | payload (length bytes) | zero padding to a multiple of 8

``durable`` is the number of records known durable (synced) when the frame was written: every record with a smaller
seq was. Recovery uses it to tell a torn tail (damage after the last sync) from damage to records that had been made
durable (an error, never cut). Integers are little-endian.

A frame's mark can only vouch for the records before it, so the records of the last sync (one ``append_many``, one
batch) would have no evidence. The writer therefore also keeps a sync mark in a small file beside the segments
(``DURABLE``), rewritten after each sync and never synced itself: whatever value of it survives a crash was true
when written (every record below it had been synced), and a damaged one fails its checksum and is ignored:

    sync mark   magic b"LPJSYNC1" | durable u64 | reserved u64 (0) | xxh3-64 of the 24 bytes before
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

SEGMENT_MAGIC = b"LPJSEG1\n"
SEGMENT_HEADER = struct.Struct("<8sQQQ")
FRAME_HEADER = struct.Struct("<IIQQQ")
HEADER_BYTES = 32
MAX_RECORD_BYTES = 1 << 30  # one record; larger ones are refused when appended and are damage when read
SEGMENT_SUFFIX = ".seg"
SYNC_MAGIC = b"LPJSYNC1"
SYNC_MARK_NAME = "DURABLE"
SEQ_DIGITS = 20


def segment_name(first_seq: int) -> str:
    return f"{first_seq:0{SEQ_DIGITS}d}{SEGMENT_SUFFIX}"


def segment_seq(name: str) -> int | None:
    """The first seq a segment file name gives, or None when the name is not a segment's."""
    stem = name[: -len(SEGMENT_SUFFIX)]
    if not name.endswith(SEGMENT_SUFFIX) or len(stem) != SEQ_DIGITS or not stem.isdigit() or not stem.isascii():
        return None
    return int(stem)


def segment_header(first_seq: int) -> bytes:
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, first_seq, 0, 0)[:24]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def parse_segment_header(data: bytes) -> int | None:
    """The first seq a segment header records, or None when it is short or damaged."""
    if len(data) < HEADER_BYTES:
        return None
    magic, first, reserved, check = SEGMENT_HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC or reserved != 0 or check != xxhash.xxh3_64_intdigest(data[:24]):
        return None
    return int(first)


def sync_mark(durable: int) -> bytes:
    head = SEGMENT_HEADER.pack(SYNC_MAGIC, durable, 0, 0)[:24]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def parse_sync_mark(data: bytes) -> int | None:
    """The count of durable records a sync mark records, or None when it is short, damaged or not one."""
    if len(data) != HEADER_BYTES:
        return None
    magic, durable, reserved, check = SEGMENT_HEADER.unpack_from(data)
    if magic != SYNC_MAGIC or reserved != 0 or check != xxhash.xxh3_64_intdigest(data[:24]):
        return None
    return int(durable)


def padded(n: int) -> int:
    return (n + 7) & ~7


def frame(seq: int, durable: int, payload: bytes | memoryview) -> bytes:
    """One record's frame: header, payload, padding."""
    n = len(payload)
    if n > MAX_RECORD_BYTES:
        raise ValueError(f"a journal record holds at most {MAX_RECORD_BYTES} bytes, not {n}")
    head = struct.pack("<IIQQ", n, 0, seq, durable)
    check = xxhash.xxh3_64(head)
    check.update(payload)
    return b"".join((head, struct.pack("<Q", check.intdigest()), payload, bytes(padded(n) - n)))


@dataclass(frozen=True)
class Frame:
    seq: int
    durable: int
    offset: int  # of the frame in its segment
    size: int  # frame bytes, padding included
    payload: memoryview


def read_frame(buf: memoryview, pos: int, seq: int | None = None) -> Frame | None:
    """The whole, intact frame at ``pos`` of ``buf`` (padding included; with sequence number ``seq`` when given), or
    None."""
    if pos + HEADER_BYTES > len(buf):
        return None
    n, flags, fseq, durable, check = FRAME_HEADER.unpack_from(buf, pos)
    if flags != 0 or n > MAX_RECORD_BYTES or (seq is not None and fseq != seq) or durable > fseq + 1:
        return None
    end = pos + HEADER_BYTES + n
    if pos + HEADER_BYTES + padded(n) > len(buf):  # the padding too: the next frame starts 8-byte aligned
        return None
    h = xxhash.xxh3_64(buf[pos : pos + 24])
    h.update(buf[pos + HEADER_BYTES : end])
    if h.intdigest() != check:
        return None
    return Frame(fseq, durable, pos, HEADER_BYTES + padded(n), buf[pos + HEADER_BYTES : end])


def frames_after(buf: memoryview, pos: int, seq: int) -> tuple[Frame | None, Frame | None]:
    """(the first intact frame after ``pos`` (8-byte aligned) whose ``durable`` says record ``seq`` had been synced
    when it was written, the first intact frame after ``pos`` with a later seq), either None when there is none.
    Candidates are found by their seq field (vectorised), then checked whole."""
    start = pos + 8
    usable = (len(buf) - start) // 8 * 8
    if usable < HEADER_BYTES:
        return None, None
    words = np.frombuffer(buf[start : start + usable], dtype="<u8")
    first: Frame | None = None
    # A frame at byte p has its seq at p + 8, i.e. at word (p + 8 - start) / 8 of this view.
    for i in np.nonzero((words > seq) & (words < seq + (1 << 40)))[0]:
        p = start + int(i) * 8 - 8
        if p <= pos:
            continue
        f = read_frame(buf, p)
        if f is None:
            continue
        first = first or f
        if f.durable > seq:
            return f, first
    return None, first

"""Fuzz the log's segments and frames (docs/format.md §16) with hypothesis: segment headers, frame headers, lengths,
durability marks, the sync mark file, whole segments. A few logs are built (groups of records sharing one durability
mark, syncs at random points, several segments); each example damages a copy of one (bit flips, overwrites with
random or zero bytes, truncations, insertions, a removed segment) and opens it, as a writer and read-only.

Every outcome must be a clean open or a luopan error, never another exception; an open must give back only records
with their original bytes, contiguous from the first; and no record whose frame is still intact and that a surviving
durability mark covers (a later intact frame's mark, or the intact sync mark) may be missing: that would be an intact,
acknowledged record silently dropped. After a writer's open, the log takes an append and reopens without recovery.

Bounded in CI (``LUOPAN_FUZZ_EXAMPLES``, 200 by default).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luopan.errors import LuopanError
from luopan.format.records import HEADER_BYTES, SYNC_MARK_NAME, parse_sync_mark, read_frame
from luopan.repository.wal import Log

FUZZ_EXAMPLES = int(os.environ.get("LUOPAN_FUZZ_EXAMPLES", "200"))
BASES = 6


@dataclass
class Base:
    files: dict[str, bytes]  # name -> bytes (segments and the sync mark)
    payloads: dict[int, bytes]
    frames: dict[str, list[tuple[int, int, int, int]]]  # segment name -> (seq, offset, size, durable)


_CACHE: dict[int, Base] = {}


def base(n: int) -> Base:
    """Log ``n``: built once, deterministically."""
    if n in _CACHE:
        return _CACHE[n]
    rng = random.Random(n)
    d = tempfile.mkdtemp(prefix="luopan-fuzz-log-")
    try:
        payloads: dict[int, bytes] = {}
        fsync = ("always", "batch", "off")[n % 3]
        with Log(d, fsync=fsync, segment_bytes=4096, batch_records=1000, batch_ms=3_600_000) as log:
            for _ in range(rng.randrange(3, 12)):
                group = [rng.randbytes(rng.choice([0, 1, 7, 8, 60, 500, 1400])) for _ in range(rng.randrange(1, 5))]
                for s, p in zip(log.append_many(group), group):
                    payloads[s] = p
                if rng.random() < 0.4:
                    log.sync()
            if rng.random() < 0.5:
                log.sync()
        files = {}
        frames: dict[str, list[tuple[int, int, int, int]]] = {}
        for name in sorted(os.listdir(d)):
            if name == "LOCK":
                continue
            with open(os.path.join(d, name), "rb") as f:
                files[name] = f.read()
            if name.endswith(".seg"):
                buf, pos, out = memoryview(files[name]), HEADER_BYTES, []
                while (fr := read_frame(buf, pos)) is not None:
                    out.append((fr.seq, pos, fr.size, fr.durable))
                    pos += fr.size
                frames[name] = out
    finally:
        shutil.rmtree(d)
    _CACHE[n] = Base(files, payloads, frames)
    return _CACHE[n]


@st.composite
def damage(draw: st.DrawFn) -> tuple[int, list[tuple]]:
    n = draw(st.integers(0, BASES - 1))
    b = base(n)
    names = sorted(b.files)
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        size = max(1, len(b.files[name]))
        kind = draw(st.sampled_from(["flip", "random", "zeros", "truncate", "insert", "remove", "header", "frame"]))
        if kind == "frame" and name in b.frames and b.frames[name]:
            # a field of a frame header: length, flags, seq, durable or checksum
            _seq, off, _sz, _dur = draw(st.sampled_from(b.frames[name]))
            at = off + draw(st.integers(0, HEADER_BYTES - 1))
            ops.append(("random", name, at, draw(st.integers(1, 8)), draw(st.binary(min_size=8, max_size=8))))
        elif kind == "header":
            ops.append(("flip", name, draw(st.integers(0, HEADER_BYTES - 1)), draw(st.integers(0, 7))))
        elif kind == "flip":
            ops.append(("flip", name, draw(st.integers(0, size - 1)), draw(st.integers(0, 7))))
        elif kind in ("random", "zeros"):
            at = draw(st.integers(0, size - 1))
            length = draw(st.integers(1, 600))
            ops.append((kind, name, at, length, draw(st.binary(min_size=length, max_size=length))))
        elif kind == "truncate":
            ops.append(("truncate", name, draw(st.integers(0, size))))
        elif kind == "insert":
            ops.append(("insert", name, draw(st.integers(0, size)), draw(st.binary(min_size=1, max_size=64))))
        else:
            ops.append(("remove", name))
    return n, ops


def apply(files: dict[str, bytes], ops: list[tuple]) -> dict[str, bytes]:
    out = {k: bytearray(v) for k, v in files.items()}
    for op in ops:
        kind, name = op[0], op[1]
        if name not in out:
            continue
        data = out[name]
        if kind == "flip" and op[2] < len(data):
            data[op[2]] ^= 1 << op[3]
        elif kind == "random":
            at, length, junk = op[2], op[3], op[4]
            data[at : at + length] = (junk * (length // max(1, len(junk)) + 1))[: len(data[at : at + length])]
        elif kind == "zeros":
            at, length = op[2], op[3]
            data[at : at + length] = bytes(len(data[at : at + length]))
        elif kind == "truncate":
            del data[op[2]:]
        elif kind == "insert":
            data[op[2] : op[2]] = op[3]
        elif kind == "remove":
            del out[name]
    return {k: bytes(v) for k, v in out.items()}


def must_survive(b: Base, damaged: dict[str, bytes]) -> set[int]:
    """Records whose frames are intact where they were and that a surviving durability mark covers."""
    intact: set[int] = set()
    mark = 0
    for name, frames in b.frames.items():
        data = damaged.get(name)
        if data is None or data[:HEADER_BYTES] != b.files[name][:HEADER_BYTES]:
            continue
        for seq, off, size, durable in frames:
            if data[off : off + size] == b.files[name][off : off + size]:
                intact.add(seq)
                mark = max(mark, durable)
    if damaged.get(SYNC_MARK_NAME) == b.files.get(SYNC_MARK_NAME):
        mark = max(mark, parse_sync_mark(b.files.get(SYNC_MARK_NAME, b"")) or 0)
    return {s for s in intact if s < mark}


def check_open(d: str, b: Base, must: set[int], read_only: bool) -> None:
    try:
        log = Log(d, read_only=read_only, segment_bytes=4096)
    except LuopanError:
        return
    with log:
        try:
            got = dict(log.items(log.first_seq))
        except LuopanError:
            return
        assert list(got) == list(range(log.first_seq, log.next_seq)), "records must be contiguous"
        for s, p in got.items():
            assert p == b.payloads[s], f"record {s} came back changed"
        missing = must - set(got)
        assert not missing, f"intact records a durability mark covers were dropped: {sorted(missing)}"
        if not read_only:
            s = log.append(b"after")
            assert log.get(s) == b"after"
    if not read_only:
        with Log(d) as again:
            assert again.recovered == [] and again.get(s) == b"after"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damage())
def test_damaged_logs_open_cleanly_or_raise_luopan_errors(case):
    n, ops = case
    b = base(n)
    damaged = apply(b.files, ops)
    must = must_survive(b, damaged)
    d = tempfile.mkdtemp(prefix="luopan-fuzz-open-")
    try:
        for read_only in (True, False):
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
            for name, data in damaged.items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
            check_open(d, b, must, read_only)
    finally:
        shutil.rmtree(d)


@pytest.mark.parametrize("n", range(BASES))
def test_bases_are_not_trivial(n):
    """The logs fuzzed hold several segments, groups sharing a mark and a sync mark (else the fuzz proves little)."""
    b = base(n)
    assert len(b.payloads) >= 3 and any(name.endswith(".seg") for name in b.files)


def test_bases_cover_groups_several_segments_and_sync_marks():
    bases = [base(n) for n in range(BASES)]
    assert any(sum(name.endswith(".seg") for name in b.files) > 1 for b in bases)
    assert any(parse_sync_mark(b.files.get(SYNC_MARK_NAME, b"")) for b in bases)
    assert any(len({f[3] for f in fr}) < len(fr) for b in bases for fr in b.frames.values())

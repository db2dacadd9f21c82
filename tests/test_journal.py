"""luopan.journal.Journal: records, durability modes, recovery, compaction into snapshots (docs/format.md §16)."""

from __future__ import annotations

import glob
import os
import time

import pytest

import luopan
from luopan.errors import (
    CorruptJournalError,
    IntegrityError,
    InvalidNameError,
    JournalBusyError,
    RecordNotFoundError,
    UsageError,
)
from luopan.journal import Journal
from luopan.repository import wal


def segments(repo_dir, name="main"):
    return sorted(glob.glob(os.path.join(repo_dir, "journals", name, "log", "*.seg")))


def test_append_read_get_and_reopen(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        assert j.last_seq == -1 and list(j.read()) == []
        assert j.append({"step": 0, "msg": "hello"}) == 0
        assert j.append(b"\x00raw bytes") == 1
        assert j.append_many([{"step": 2}, b"three"]) == [2, 3]
        assert j.last_seq == 3
        assert list(j.read()) == [{"step": 0, "msg": "hello"}, b"\x00raw bytes", {"step": 2}, b"three"]
        assert list(j.items(2)) == [(2, {"step": 2}), (3, b"three")]
        assert j.get(1) == b"\x00raw bytes"
    with Journal(d) as j:  # reopened: everything is there, appends continue the numbering
        assert j.recovered == [] and j.last_seq == 3
        assert j.append({"step": 4}) == 4
        assert list(j.read(3)) == [b"three", {"step": 4}]
        with pytest.raises(RecordNotFoundError):
            j.get(5)
    assert luopan.open(d).config.format_version >= 1  # the journal lives in an ordinary repository


def test_bad_input_is_refused_with_clear_errors(tmp_path):
    d = str(tmp_path / "repo")
    with pytest.raises(UsageError, match="fsync must be one of"):
        Journal(d, fsync="sometimes")
    with pytest.raises(InvalidNameError):
        Journal(d, name="../escape")
    with Journal(d) as j:
        with pytest.raises(UsageError, match="bytes or a JSON-able dict"):
            j.append({1, 2})
        with pytest.raises(UsageError, match="not JSON"):
            j.append({"x": object()})
        with pytest.raises(UsageError):
            j.append({"x": float("nan")})
        assert j.last_seq == -1  # nothing was written by the refused appends


def test_one_writer_at_a_time_and_readers_beside_it(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        j.append({"a": 1})
        with pytest.raises(JournalBusyError):
            Journal(d)
        with Journal(d, read_only=True) as r:
            assert list(r.read()) == [{"a": 1}]
            with pytest.raises(UsageError, match="read_only"):
                r.append({"b": 2})


def test_segments_rotate_and_records_span_them(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d, segment_bytes=4096) as j:
        for i in range(200):
            j.append({"i": i, "pad": "x" * 100})
        assert len(segments(d)) > 5
        assert [r["i"] for r in j.read(150)] == list(range(150, 200))
    with Journal(d, segment_bytes=4096) as j:
        assert [r["i"] for r in j.read()] == list(range(200))


def test_fsync_modes_sync_as_documented(tmp_path, monkeypatch):
    syncs = []
    real = wal._sync
    monkeypatch.setattr(wal, "_sync", lambda fd, path: (syncs.append(path), real(fd, path)))
    with Journal(str(tmp_path / "a"), fsync="always") as j:
        n0 = len(syncs)
        for i in range(10):
            j.append({"i": i})
        assert len(syncs) - n0 == 10  # one sync per acknowledged record
    with Journal(str(tmp_path / "b"), fsync="batch", batch_records=5, batch_ms=60_000) as j:
        n0 = len(syncs)
        for i in range(12):
            j.append({"i": i})
        assert len(syncs) - n0 == 2  # after the 5th and the 10th: at most batch_records unsynced
    with Journal(str(tmp_path / "c"), fsync="batch", batch_records=1000, batch_ms=20) as j:
        n0 = len(syncs)
        j.append({"i": 0})
        deadline = time.monotonic() + 5
        while len(syncs) == n0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(syncs) == n0 + 1  # synced by the timer, batch_ms after the first unsynced record
    with Journal(str(tmp_path / "d"), fsync="off") as j:
        n0 = len(syncs)
        for i in range(10):
            j.append({"i": i})
        j.sync()  # an explicit sync works in every mode
        assert len(syncs) - n0 == 1


def test_torn_tail_is_cut_and_reported(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        for i in range(5):
            j.append({"i": i})
    seg = segments(d)[-1]
    size = os.path.getsize(seg)
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00" + b"\x00" * 12)  # a record header that never got its payload
    with Journal(d) as j:
        assert len(j.recovered) == 1
        rec = j.recovered[0]
        assert rec.offset == size and rec.bytes_cut == 16 and rec.next_seq == 5 and rec.cut
        assert "torn tail" in str(rec)
        assert [r["i"] for r in j.read()] == list(range(5))
        assert j.append({"i": 5}) == 5
    assert os.path.getsize(seg) > size


def test_damage_in_the_middle_is_an_error_naming_segment_and_offset(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d, segment_bytes=4096) as j:
        for i in range(100):
            j.append({"i": i, "pad": "y" * 80})
    first = segments(d)[0]
    before = open(first, "rb").read()
    with open(first, "r+b") as f:  # a byte of a record in a complete (not the last) segment
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptJournalError) as e:
        Journal(d, segment_bytes=4096)
    assert e.value.segment == first and 0 < e.value.offset <= 200
    assert first in str(e.value) and f"offset {e.value.offset}" in str(e.value)
    assert os.path.getsize(first) == len(before)  # nothing was cut


def test_damage_to_a_durable_record_of_the_last_segment_is_an_error(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:  # "always": every later frame records that the earlier ones were durable
        for i in range(10):
            j.append({"i": i})
    seg = segments(d)[-1]
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.seek(32 + 40)  # inside the first record
        f.write(b"\xff\xff")
    with pytest.raises(CorruptJournalError, match="made durable"):
        Journal(d)
    assert os.path.getsize(seg) == size


def test_compact_shares_unchanged_parts_and_drops_covered_segments(tmp_path):
    d = str(tmp_path / "repo")
    rng = __import__("random").Random(0)
    state = bytearray(rng.randbytes(2 << 20))
    with Journal(d, segment_bytes=8192) as j:
        for i in range(300):
            j.append({"i": i, "pad": "z" * 60})
        n_before = len(segments(d))
        s1 = j.compact(bytes(state), metadata={"note": "first"})
        assert s1 == 300 and j.snapshots() == [300]
        assert len(segments(d)) == 1 and j.first_seq <= 300 < n_before * 1000
        with pytest.raises(RecordNotFoundError, match="compacted"):
            list(j.read(0))
        state[1_000_000:1_000_010] = b"0123456789"  # a small change in the middle
        j.append({"i": 300})
        s2 = j.compact(bytes(state))
        snap = j.latest_snapshot()
        assert snap.seq == s2 == 301 and snap.value == bytes(state)
        assert snap.new_bytes < 300_000  # only the chunks around the change were stored again
        assert snap.logical_bytes == len(state)
        assert j.load_snapshot(300).metadata == {"note": "first"}
    with Journal(d) as j:
        assert j.latest_snapshot().value == bytes(state) and j.next_seq == 301


def test_snapshot_json_and_retention_and_gc(tmp_path):
    d = str(tmp_path / "repo")
    repo = luopan.open(d)
    j = repo.journal("agent")
    for k in range(4):
        j.append({"k": k})
        j.compact({"upto": k, "blob": "q" * 5000 * (k + 1)})
    assert j.snapshots() == [1, 2, 3, 4]
    assert j.latest_snapshot().value["upto"] == 3
    plan = j.prune(keep_last=2)
    assert plan.remove == [1, 2] and j.snapshots() == [3, 4]
    with pytest.raises(UsageError):
        j.prune(keep_last=0)
    repo.gc(grace=0)
    assert repo.verify().problems == []
    assert j.latest_snapshot().value["upto"] == 3  # gc kept what the remaining snapshots need
    assert j.load_snapshot(3).value["blob"] == "q" * 5000 * 3
    assert repo.du()["journals"] == 2
    j.close()


def test_a_damaged_snapshot_chunk_is_found(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        j.append({"a": 1})
        j.compact(os.urandom(100_000))  # incompressible: stored raw, so offset 100 is inside the chunk
    pack = glob.glob(os.path.join(d, "packs", "*", "*"))[0]
    with open(pack, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))  # always a change (writing a fixed byte matched the random one 1 time in 256)
    with Journal(d) as j:
        with pytest.raises(IntegrityError):
            j.latest_snapshot()
    with pytest.raises(IntegrityError) as e:  # and `verify` of the whole repository names it
        luopan.open(d).verify()
    assert "journal 'main' seq 1" in str(e.value)


def test_an_empty_log_after_a_snapshot_continues_at_its_seq(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        for i in range(3):
            j.append({"i": i})
        j.compact({"n": 3})
    for seg in segments(d):
        os.unlink(seg)  # e.g. the log directory was lost, the snapshot kept
    with Journal(d) as j:
        assert j.next_seq == 3 and j.append({"i": 3}) == 3
        assert j.latest_snapshot().value == {"n": 3}


def test_journal_on_an_object_store_is_refused(tmp_path):
    from luopan.store.memory import MemoryStore

    repo = luopan.open(MemoryStore())
    with pytest.raises(UsageError, match="local filesystem"):
        Journal(repo)


def test_snapshots_of_a_tiered_repository_replicate(tmp_path):
    repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"))
    j = repo.journal("agent")
    j.append({"a": 1})
    seq = j.compact(b"state" * 10_000)
    assert repo.wait_replicated(60)
    assert (tmp_path / "remote" / "journals" / "agent" / "_v" / f"{seq:08d}.json").exists()
    j.close()
    repo.close()
    remote = luopan.open(tmp_path / "remote")
    remote.verify()
    assert remote.du()["journals"] == 1


def test_log_files_are_the_journals_own_and_other_files_are_strays(tmp_path):
    d = tmp_path / "repo"
    with Journal(str(d), name="agent") as j:
        j.append({"a": 1})
        j.compact({"s": 1})
        j.append({"a": 2})
    (d / "journals" / "agent" / "notes.txt").write_text("mine")
    report = luopan.open(d).verify()
    strays = [s.key for s in report.strays]
    assert strays == ["journals/agent/notes.txt"]  # the segments and LOCK under log/ are not strays

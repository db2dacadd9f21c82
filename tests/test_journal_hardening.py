"""The log under a full disk, a failing disk, power loss and damage (issue 27): a failed append leaves the log as it
was, a reopened writer syncs before it vouches, compaction's unlinks are ordered, new directories are synced into
their parents, header damage and damage inside a group of records sharing a durability mark are errors (nothing
intact cut), compact(upto=) below the latest snapshot is refused, a read-only reader survives the writer's
compaction, records with non-string keys are refused."""

from __future__ import annotations

import errno
import glob
import os

import pytest

from luopan.errors import (
    CorruptJournalError,
    RecordNotFoundError,
    StorageError,
    StorageFullError,
    UsageError,
)
from luopan.format.records import HEADER_BYTES, SYNC_MARK_NAME
from luopan.journal import Journal
from luopan.repository import wal, walscan
from luopan.repository.wal import Log


def segs(d: str) -> list[str]:
    return sorted(glob.glob(os.path.join(d, "*.seg")))


def contents(d: str) -> dict[str, bytes]:
    out = {}
    for p in segs(d):
        with open(p, "rb") as f:
            out[p] = f.read()
    return out


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def failing_write(n: int, code: int):
    """A _write whose ``n``-th call (from 1) writes half its bytes, then fails with ``code``, as a full disk does."""
    calls = {"n": 0}
    real = wal._write

    def write(fd: int, data: bytes, path: str) -> None:
        calls["n"] += 1
        if calls["n"] == n:
            os.write(fd, bytes(data)[: len(data) // 2])
            raise OSError(code, os.strerror(code))
        real(fd, data, path)

    return write


# -- 1. a failed append leaves the log as it was ------------------------------------------------------------------
@pytest.mark.parametrize("code,cls", [(errno.ENOSPC, StorageFullError), (errno.EDQUOT, StorageFullError),
                                      (errno.EIO, StorageError)])
def test_failed_append_leaves_the_log_as_it_was(tmp_path, monkeypatch, code, cls):
    d = str(tmp_path / "log")
    with Log(d) as log:
        log.append_many([b"a" * 100, b"b" * 100])
        before = contents(d)
        monkeypatch.setattr(wal, "_write", failing_write(2, code))  # the 2nd frame of the call fails half-way
        with pytest.raises(cls) as info:
            log.append_many([b"c" * 300, b"d" * 300, b"e" * 300])
        assert not isinstance(info.value, StorageFullError) or code != errno.EIO
        assert segs(d)[-1] in str(info.value) and "as it was before" in str(info.value)
        assert contents(d) == before and log.next_seq == 2
        monkeypatch.undo()
        assert log.append(b"after the disk was freed") == 2  # acknowledged, and not behind a partial frame
    with Log(d) as log:
        assert log.recovered == []
        assert [p for _s, p in log.items()] == [b"a" * 100, b"b" * 100, b"after the disk was freed"]


def test_failed_append_whose_cut_fails_poisons_the_log(tmp_path, monkeypatch):
    d = str(tmp_path / "log")
    log = Log(d)
    log.append(b"kept")
    monkeypatch.setattr(wal, "_write", failing_write(1, errno.ENOSPC))
    monkeypatch.setattr(wal, "_truncate", lambda fd, size, path: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(StorageError, match="reopen"):
        log.append(b"x" * 500)
    monkeypatch.undo()
    for _ in range(2):  # every later append raises until reopened
        with pytest.raises(StorageError, match="reopen"):
            log.append(b"refused")
    with pytest.raises(StorageError, match="reopen"):  # closing says so too, and releases the log
        log.close()
    with Log(d) as again:  # opening cuts the partial frame as a torn tail
        assert [p for _s, p in again.items()] == [b"kept"]
        assert again.append(b"next") == 1


def test_failed_sync_poisons_and_cuts_the_unacknowledged_records(tmp_path, monkeypatch):
    d = str(tmp_path / "log")
    log = Log(d)
    log.append(b"kept")
    before = contents(d)
    monkeypatch.setattr(wal, "_sync", lambda fd, path: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(StorageError) as info:
        log.append(b"never acknowledged")
    assert not isinstance(info.value, StorageFullError) and segs(d)[-1] in str(info.value)
    monkeypatch.undo()
    assert contents(d) == before
    with pytest.raises(StorageError, match="reopen"):  # never retried and trusted
        log.append(b"refused")
    with pytest.raises(StorageError, match="reopen"):
        log.close()
    with Log(d) as again:
        assert [p for _s, p in again.items()] == [b"kept"]


def test_failed_rotation_leaves_no_segment_behind(tmp_path, monkeypatch):
    d = str(tmp_path / "log")
    with Log(d, segment_bytes=4096) as log:
        log.append(b"x" * 3000)
        monkeypatch.setattr(wal, "_write", failing_write(1, errno.ENOSPC))  # the new segment's header
        with pytest.raises(StorageFullError):
            log.append(b"y" * 3000)
        monkeypatch.undo()
        assert len(segs(d)) == 1
        log.append(b"small")  # fits the old segment: appended there, and the log stays contiguous
        log.append(b"z" * 3000)
    with Log(d) as log:
        assert [len(p) for _s, p in log.items()] == [3000, 5, 3000]


def test_journal_errors_are_luopan_errors_naming_the_file(tmp_path, monkeypatch):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        j.append({"a": 1})
        monkeypatch.setattr(wal, "_write", failing_write(1, errno.ENOSPC))
        with pytest.raises(StorageFullError, match=r"\.seg"):
            j.append({"a": 2})
        monkeypatch.undo()
        assert j.append({"a": 3}) == 1

    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(walscan, "_read", unreadable)
    with pytest.raises(StorageError, match=r"I/O error reading .*\.seg"):
        Journal(d)


# -- 2. a reopened writer syncs the tail before it vouches for it ---------------------------------------------------
def test_reopened_writer_syncs_the_tail_before_its_first_frame(tmp_path, monkeypatch):
    d = str(tmp_path / "log")
    with Log(d, fsync="off") as log:  # written, never synced (a writer killed in "off" or "batch" mode)
        log.append_many([b"a", b"b", b"c"])
    events = []
    real_write, real_sync = wal._write, wal._sync
    monkeypatch.setattr(wal, "_write", lambda fd, data, path: (events.append(("write", path)),
                                                               real_write(fd, data, path)))
    monkeypatch.setattr(wal, "_sync", lambda fd, path: (events.append(("sync", path)), real_sync(fd, path)))
    with Log(d, fsync="batch", batch_ms=60_000) as log:
        log.append(b"d")  # its frame says records < 3 are durable
        tail = segs(d)[-1]
        first_write = events.index(("write", tail))
        assert ("sync", tail) in events[:first_write]


# -- 3. compaction's unlinks are ordered --------------------------------------------------------------------------
def test_drop_before_syncs_the_directory_after_each_unlink(tmp_path, monkeypatch):
    d = str(tmp_path / "log")
    with Log(d, segment_bytes=4096) as log:
        for i in range(12):
            log.append(b"%d" % i * 1500)
        assert len(segs(d)) >= 4
        events = []
        real_unlink, real_sync_dir = wal._unlink, wal._sync_dir
        monkeypatch.setattr(wal, "_unlink", lambda p: (events.append(("unlink", p)), real_unlink(p)))
        monkeypatch.setattr(wal, "_sync_dir", lambda p: (events.append(("syncdir", p)), real_sync_dir(p)))
        names = segs(d)
        log.drop_before(log.segments[-1].first_seq)
    unlinked = [e[1] for e in events if e[0] == "unlink"]
    assert unlinked == names[:-1]  # oldest first
    for i, e in enumerate(events):  # and each unlink is durable before the next one starts
        if e[0] == "unlink":
            assert events[i + 1] == ("syncdir", d)


def test_every_state_a_crash_in_compaction_can_leave_opens(tmp_path):
    """The states ordered unlinks allow (a suffix of the segments) open, with the snapshot covering the rest."""
    d = str(tmp_path / "repo")
    with Journal(d, segment_bytes=4096) as j:
        for i in range(12):
            j.append({"i": i, "pad": "x" * 1500})
        j.sync()
    logdir = os.path.join(d, "journals", "main", "log")
    names = segs(logdir)
    saved = contents(logdir)
    with Journal(d, segment_bytes=4096) as j:
        j.compact({"upto": 12})
    for k in range(len(names)):  # a crash after the k-th unlink reached the disk: names[k:] left
        for p in names[k:]:
            with open(p, "wb") as f:
                f.write(saved[p])
        with Journal(d, segment_bytes=4096) as j:
            assert j.latest_snapshot().value == {"upto": 12}
            assert j.first_seq <= 12 == j.next_seq
        for p in segs(logdir):
            os.unlink(p)
        with open(os.path.join(logdir, os.path.basename(names[-1])), "wb") as f:
            f.write(saved[names[-1]])


# -- 4. new directories are synced into their parents -------------------------------------------------------------
def test_new_directories_are_synced_into_their_parents_before_the_first_ack(tmp_path, monkeypatch):
    events = []
    real_mkdir, real_sync_dir, real_sync = wal._mkdir, wal._sync_dir, wal._sync
    monkeypatch.setattr(wal, "_mkdir", lambda p: (events.append(("mkdir", p)), real_mkdir(p)))
    monkeypatch.setattr(wal, "_sync_dir", lambda p: (events.append(("syncdir", p)), real_sync_dir(p)))
    monkeypatch.setattr(wal, "_sync", lambda fd, p: (events.append(("sync", p)), real_sync(fd, p)))
    top = str(tmp_path / "a")
    with Log(os.path.join(top, "b", "log")) as log:
        log.append(b"acknowledged")
        events.append(("ack",))
    made = [e[1] for e in events if e[0] == "mkdir"]
    assert made == [top, os.path.join(top, "b"), os.path.join(top, "b", "log")]
    ack = events.index(("ack",))
    for p in made:
        assert ("syncdir", os.path.dirname(p)) in events[:ack]


def test_a_new_journal_syncs_the_directories_it_creates(tmp_path, monkeypatch):
    d = str(tmp_path / "repo")
    Journal(d).close()  # the repository exists
    synced = []
    real = wal._sync_dir
    monkeypatch.setattr(wal, "_sync_dir", lambda p: (synced.append(p), real(p)))
    with Journal(d, name="fresh") as j:
        j.append({"a": 1})
    assert os.path.join(d, "journals") in synced and os.path.join(d, "journals", "fresh") in synced


# -- 5. header damage is damage -----------------------------------------------------------------------------------
def test_a_flipped_bit_in_a_segment_header_is_an_error_and_nothing_is_cut(tmp_path):
    d = str(tmp_path / "log")
    with Log(d) as log:
        for i in range(5):
            log.append(b"record %d" % i)
    flip(segs(d)[0], 9)
    before = contents(d)
    for read_only in (False, True):
        with pytest.raises(CorruptJournalError, match="header is damaged") as info:
            Log(d, read_only=read_only)
        assert info.value.segment == segs(d)[0] and info.value.offset == 0
    assert contents(d) == before


def test_a_torn_header_of_an_empty_segment_still_recovers(tmp_path):
    d = str(tmp_path / "log")
    with Log(d, segment_bytes=4096) as log:
        log.append(b"x" * 3000)
        log.append(b"y" * 3000)  # a second segment
    last = segs(d)[-1]
    with open(last, "r+b") as f:
        f.truncate(HEADER_BYTES - 5)  # a crash while the segment was being started (header only, cut short)
    with Log(d) as log:
        assert log.recovered and log.next_seq == 1
        assert log.append(b"again") == 1


# -- 6. damage inside a group sharing a durability mark -----------------------------------------------------------
@pytest.mark.parametrize("fsync", ["always", "batch"])
def test_damage_inside_the_last_group_is_an_error_not_a_torn_tail(tmp_path, fsync):
    d = str(tmp_path / "log")
    with Log(d, fsync=fsync, batch_records=1000, batch_ms=60_000) as log:
        log.append(b"first")
        log.append_many([b"g%d" % i * 50 for i in range(6)])  # one durability mark for all six
        log.sync()
        offsets = list(log.segments[-1].offsets)
    seg = segs(d)[0]
    flip(seg, offsets[3] + HEADER_BYTES + 3)  # record 3's payload
    before = contents(d)
    for read_only in (False, True):
        with pytest.raises(CorruptJournalError) as info:
            Log(d, read_only=read_only)
        assert info.value.offset == offsets[3] and "sync mark" in str(info.value)
    assert contents(d) == before  # records 4..6, intact and acknowledged, are still there


def three_synced_records(tmp_path):
    """A log of three records appended with fsync="always" (the sync mark vouches for all three): (its directory,
    its one segment, the records' offsets)."""
    d = str(tmp_path / "log")
    with Log(d, fsync="always") as log:
        for i in range(3):
            log.append(b"rec%d" % i * 40)
        offsets = list(log.segments[-1].offsets)
    return d, segs(d)[0], offsets


def test_damage_to_the_last_synced_record_is_an_error_not_a_torn_tail(tmp_path):
    """The last record was synced and acknowledged (the sync mark says so): a flipped bit in it is damage, not a
    crash's torn tail; nothing is cut and the log is refused."""
    d, seg, offsets = three_synced_records(tmp_path)
    flip(seg, offsets[2] + HEADER_BYTES + 5)
    before = contents(d)
    for read_only in (False, True):
        with pytest.raises(CorruptJournalError) as info:
            Log(d, read_only=read_only)
        assert info.value.offset == offsets[2] and "sync mark" in str(info.value)
    assert contents(d) == before


def test_a_copy_of_a_live_log_cut_inside_its_last_record_opens(tmp_path):
    """A copy made segment by segment while the writer runs can end mid-record while the sync mark, copied later,
    vouches for that record: a record cut short at the end of the file is a torn tail, whatever the mark says."""
    d, seg, _offsets = three_synced_records(tmp_path)
    os.truncate(seg, os.path.getsize(seg) - 7)
    with Log(d) as log:
        assert log.recovered and log.next_seq == 2
        assert [p for _s, p in log.items()] == [b"rec0" * 40, b"rec1" * 40]


def test_a_synced_last_record_zeroed_to_the_end_of_the_file_is_a_torn_tail(tmp_path):
    """A disk whose cache ignored a flush can leave the file's length with zeros from inside the last record on:
    not bit rot (which flips bits), so it is cut as a torn tail although the sync mark covers the record."""
    d, seg, offsets = three_synced_records(tmp_path)
    size = os.path.getsize(seg)
    with open(seg, "r+b") as f:
        f.seek(offsets[2] + HEADER_BYTES + 20)
        f.write(bytes(size - offsets[2] - HEADER_BYTES - 20))
    with Log(d) as log:
        assert log.recovered and log.next_seq == 2


def test_unsynced_records_reaching_the_disk_out_of_order_are_a_torn_tail(tmp_path):
    """A crash can persist a later page of the unsynced tail and lose an earlier one: nothing vouches for those
    records (neither a frame's mark nor the sync mark), so they are cut, and the log opens."""
    d = str(tmp_path / "log")
    with Log(d, fsync="always") as log:
        log.append(b"durable")
    with Log(d, fsync="off") as log:
        log.append_many([b"u%d" % i * 600 for i in range(8)])
        offsets = list(log.segments[-1].offsets)
    seg = segs(d)[0]
    with open(seg, "r+b") as f:  # the page holding record 2 never reached the disk; later ones did
        f.seek(offsets[2])
        f.write(bytes(offsets[3] - offsets[2]))
    with Log(d) as log:
        assert log.recovered and log.next_seq == 2
        assert [p for _s, p in log.items()][:1] == [b"durable"]


def test_the_sync_mark_never_vouches_for_more_than_was_synced(tmp_path):
    d = str(tmp_path / "log")
    with Log(d, fsync="batch", batch_records=1000, batch_ms=60_000) as log:
        log.append_many([b"a", b"b"])
        log.sync()
        log.append(b"c")  # written, not synced
        with open(os.path.join(d, SYNC_MARK_NAME), "rb") as f:
            assert walscan.parse_sync_mark(f.read()) == 2
        log.sync()
        with open(os.path.join(d, SYNC_MARK_NAME), "rb") as f:
            assert walscan.parse_sync_mark(f.read()) == 3


# -- 11. compact(upto=) below the latest snapshot -----------------------------------------------------------------
def test_compact_below_the_latest_snapshot_is_refused_before_anything_is_written(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d) as j:
        for i in range(10):
            j.append({"i": i})
        j.compact({"s": 8}, upto=8)
        files = sorted(os.path.relpath(os.path.join(t, f), d) for t, _ds, fs in os.walk(d) for f in fs)
        with pytest.raises(UsageError, match="below the latest snapshot"):
            j.compact({"s": 4}, upto=4)
        assert sorted(os.path.relpath(os.path.join(t, f), d) for t, _ds, fs in os.walk(d) for f in fs) == files
        assert j.snapshots() == [8]
        assert j.compact({"s": 10}) == 10  # at or above it is fine


# -- 16. a read-only reader and the writer's compaction ----------------------------------------------------------
def test_read_only_reader_after_the_writer_compacts_gets_a_typed_error(tmp_path):
    d = str(tmp_path / "repo")
    with Journal(d, segment_bytes=4096) as w:
        for i in range(10):
            w.append({"i": i, "pad": "x" * 1500})
        reader = Journal(d, read_only=True)
        assert reader.get(0)["i"] == 0
        w.compact({"upto": 10})
        with pytest.raises(RecordNotFoundError, match="reopen the journal"):
            list(reader.read())
        with pytest.raises(RecordNotFoundError, match="reopen the journal"):
            reader.get(1)
        reader.close()
        with Journal(d, read_only=True) as again:  # a new reader starts from the snapshot
            assert again.latest_snapshot().value == {"upto": 10} and again.first_seq >= 8


def test_read_only_journal_without_a_log_yet_is_empty(tmp_path):
    d = str(tmp_path / "repo")
    Journal(d, name="other").close()
    with Journal(d, name="never-written", read_only=True) as j:
        assert list(j.read()) == [] and j.next_seq == 0


# -- records with non-string keys ---------------------------------------------------------------------------------
def test_records_with_non_string_keys_are_refused(tmp_path):
    with Journal(str(tmp_path / "repo")) as j:
        with pytest.raises(UsageError, match=r"the key 1 in record\['a'\].*str\(\)"):
            j.append({"a": {1: "one"}})
        with pytest.raises(UsageError, match="the key 2"):
            j.append_many([{"ok": 1}, {"list": [{2: "x"}]}])
        assert j.next_seq == 0  # nothing of the refused call was appended
        with pytest.raises(UsageError, match="the key"):
            j.compact({3: "x"})
        j.append({"a": {"1": "one"}})
        assert list(j.read()) == [{"a": {"1": "one"}}]


# -- verify, check and doctor read the logs -----------------------------------------------------------------------
def test_verify_check_and_doctor_read_journal_segments(tmp_path):
    import luopan
    import luopan.doctor
    from luopan.checkpoint.checking import check
    from luopan.errors import IntegrityError

    d = str(tmp_path / "repo")
    with Journal(d, name="agent") as j:  # what a LangGraph saver writes through (the same log code)
        j.append_many([{"i": i, "pad": "x" * 100} for i in range(6)])
    repo = luopan.open(d)
    try:
        repo.verify()
        assert not check(repo).problems
        assert [f.status for f in luopan.doctor.run_checks(repo) if f.check == "logs"] == ["ok"]
        seg = segs(os.path.join(d, "journals", "agent", "log"))[0]
        flip(seg, HEADER_BYTES + 40)  # record 0's payload: later records vouch for it
        with pytest.raises(IntegrityError) as info:
            repo.verify()
        assert any(isinstance(p, CorruptJournalError) and seg in str(p) for p in info.value.problems)
        assert any(isinstance(p, CorruptJournalError) for p in check(repo).problems)
        logs = [f for f in luopan.doctor.run_checks(repo) if f.check == "logs"]
        assert [f.status for f in logs] == ["fail"] and seg in logs[0].message
    finally:
        repo.close()
    with open(seg, "rb") as f:
        assert len(f.read()) > 600  # nothing was cut

"""Journal durability by simulation (docs/format.md §16.2): the log's writes and syncs are recorded, and for every
crash point the files are rebuilt as a crash could leave them — what was written after each file's last sync
dropped, torn, garbled, zero-filled or kept page by page in any mix ("pages"), a file whose name was never synced
into its directory possibly gone, and the sync mark (never synced) at any version written so far or absent. The
workload also abandons a writer midway without syncing (a killed process) and goes on with a new one.
Every record acknowledged in "always" mode (every record a sync covered, in "batch" and "off" modes) must survive,
no record may come back with other bytes, and the log must open and take appends again."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from luopan.repository import wal
from luopan.repository.wal import Log

MODES = ("drop", "torn", "garble", "zeros", "torn-garble", "pages")
PAGE = 512


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_write, real_sync, real_sync_dir, real_mark = wal._write, wal._sync, wal._sync_dir, wal._put_mark

        def put_mark(fd: int, data: bytes, path: str) -> None:
            self.events.append(("mark", path, bytes(data)))
            real_mark(fd, data, path)

        def write(fd: int, data: bytes, path: str) -> None:
            self.events.append(("write", path, bytes(data)))
            real_write(fd, data, path)

        def sync(fd: int, path: str) -> None:
            real_sync(fd, path)
            self.events.append(("sync", path))

        def sync_dir(path: str) -> None:
            real_sync_dir(path)
            self.events.append(("syncdir", path))

        monkeypatch.setattr(wal, "_write", write)
        monkeypatch.setattr(wal, "_sync", sync)
        monkeypatch.setattr(wal, "_sync_dir", sync_dir)
        monkeypatch.setattr(wal, "_put_mark", put_mark)


def rebuild(events: list[tuple], k: int, mode: str, rng: random.Random, dest: str, src_dir: str) -> None:
    """The directory as a crash after event ``k`` could leave it."""
    files: dict[str, dict] = {}
    marks: dict[str, list[bytes]] = {}
    for ev in events[:k]:
        if ev[0] == "mark":
            marks.setdefault(ev[1], []).append(ev[2])
        elif ev[0] == "write":
            f = files.setdefault(ev[1], {"data": bytearray(), "synced": 0, "named": False})
            f["data"] += ev[2]
        elif ev[0] == "sync":
            files[ev[1]]["synced"] = len(files[ev[1]]["data"])
        elif ev[0] == "syncdir":
            for f in files.values():
                f["named"] = True
    os.makedirs(dest)
    for path, f in files.items():
        if not f["named"] and rng.random() < 0.5:
            continue  # its directory entry never reached the disk
        data = bytes(f["data"][: f["synced"]])
        tail = bytes(f["data"][f["synced"]:])
        if tail:
            if mode == "torn":
                tail = tail[: rng.randrange(len(tail) + 1)]
            elif mode == "garble":
                tail = rng.randbytes(len(tail))
            elif mode == "zeros":
                tail = bytes(len(tail))
            elif mode == "torn-garble":
                cut = rng.randrange(len(tail) + 1)
                tail = tail[:cut] + rng.randbytes(rng.randrange(len(tail) - cut + 1))
            elif mode == "pages":  # each page of the unsynced tail reached the disk or not, in any mix
                pages = [tail[i : i + PAGE] for i in range(0, len(tail), PAGE)]
                pages = [p if rng.random() < 0.5 else rng.choice([bytes(len(p)), rng.randbytes(len(p))])
                         for p in pages]
                tail = b"".join(pages[: rng.randrange(len(pages) + 1)] if rng.random() < 0.3 else pages)
            else:
                tail = b""
        with open(os.path.join(dest, os.path.relpath(path, src_dir)), "wb") as out:
            out.write(data + tail)
    for path, versions in marks.items():  # never synced: any version written so far, or none, may be on disk
        pick = rng.randrange(len(versions) + 1)
        if pick < len(versions):
            with open(os.path.join(dest, os.path.relpath(path, src_dir)), "wb") as out:
                out.write(versions[pick])


def durable_seqs(events: list[tuple], k: int) -> set[int]:
    """Records a sync covered before event ``k`` (their frames were written before a sync of their file)."""
    pending: dict[str, list[int]] = {}
    durable: set[int] = set()
    for ev in events[:k]:
        if ev[0] == "frames":
            pending.setdefault(ev[1], []).extend(ev[2])
        elif ev[0] == "sync":
            durable.update(pending.pop(ev[1], []))
    return durable


def abandon(log: Log) -> None:
    """What a killed process leaves: the files as written, nothing synced, the lock released."""
    with log._mutex:
        log._closed = True
        log._flushed.notify_all()
        if log._fd is not None:
            os.close(log._fd)
            log._fd = None
        log._release_lock()
    if log._flusher is not None:
        log._flusher.join()


def workload(tmp: str, fsync: str, monkeypatch: pytest.MonkeyPatch, n: int = 90) -> tuple[list[tuple], dict]:
    rec = Recorder()
    rec.install(monkeypatch)
    rng = random.Random(7)
    payloads: dict[int, bytes] = {}
    log = Log(tmp, fsync=fsync, segment_bytes=4096, batch_records=4, batch_ms=10_000)
    i = 0
    killed = False
    while i < n:
        if not killed and i >= n // 2:  # the writer dies with what it wrote unsynced; a new one goes on
            abandon(log)
            log = Log(tmp, fsync=fsync, segment_bytes=4096, batch_records=4, batch_ms=10_000)
            killed = True
        batch = [rng.randbytes(rng.choice([0, 5, 40, 300, 1500])) for _ in range(rng.choice([1, 1, 1, 3]))]
        before = len(rec.events)
        seqs = log.append_many(batch)
        # Which file the frames went to: the last segment written by this call (rotation happens before a frame).
        seg = next(ev[1] for ev in reversed(rec.events[before:]) if ev[0] == "write")
        # Frames are written before the sync of the same call: place the marker before that sync.
        idx = max((j for j in range(before, len(rec.events)) if rec.events[j][0] == "write"), default=before) + 1
        rec.events.insert(idx, ("frames", seg, list(seqs)))
        for s, p in zip(seqs, batch):
            payloads[s] = p
        rec.events.append(("ack", list(seqs)))
        i += len(batch)
    log.close()
    monkeypatch.undo()
    return rec.events, payloads


@pytest.mark.parametrize("fsync", ["always", "batch", "off"])
def test_every_crash_point_keeps_what_was_made_durable(tmp_path, monkeypatch, fsync):
    src = str(tmp_path / "log")
    events, payloads = workload(src, fsync, monkeypatch)
    rng = random.Random(fsync)
    checked = 0
    for k in range(len(events) + 1):
        acked = {s for ev in events[:k] if ev[0] == "ack" for s in ev[1]}
        must = durable_seqs(events, k)
        if fsync == "always":
            assert acked <= must  # an acknowledged record was synced before append returned
        for mode in MODES:
            dest = str(tmp_path / f"crash-{k}-{mode}")
            rebuild(events, k, mode, rng, dest, src)
            with Log(dest, fsync=fsync, segment_bytes=4096) as log:
                got = dict(log.items(log.first_seq))
                missing = must - set(got)
                assert not missing, f"crash after event {k} ({mode}): durable records {sorted(missing)} lost"
                for s, p in got.items():
                    assert p == payloads[s], f"crash after event {k} ({mode}): record {s} came back changed"
                assert set(got) == set(range(log.next_seq)), "records must be contiguous"
                s = log.append(b"after the crash")
                assert s == log.last_seq and log.get(s) == b"after the crash"
            with Log(dest) as again:  # and it opens cleanly afterwards
                assert again.recovered == []
                assert again.get(s) == b"after the crash"
            shutil.rmtree(dest)
            checked += 1
    assert checked > 300


def test_simulation_sees_torn_tails(tmp_path, monkeypatch):
    """The simulation is not vacuous: some crash points leave a tail that opening cuts and reports."""
    src = str(tmp_path / "log")
    events, _ = workload(src, "batch", monkeypatch, n=30)
    rng = random.Random(1)
    cut = 0
    for k in range(len(events) + 1):
        dest = str(tmp_path / f"c{k}")
        rebuild(events, k, "torn-garble", rng, dest, src)
        with Log(dest, fsync="batch") as log:
            cut += bool(log.recovered)
        shutil.rmtree(dest)
    assert cut > 3

"""Advisory file locks for repositories on a local filesystem (docs/format.md §9.2).

A save on a local repository takes ``flock(LOCK_SH)`` on ``locks/flock`` instead of writing and deleting a durable
lock record (four fsyncs and two listings: 4-16 ms of a 1-tensor save here). The kernel drops the lock when its
holder exits, however it exits, so a flock is never stale. ``prune`` and ``gc`` take the record (as before: it makes
new saves wait behind them, and processes that lock with records see them) *and* ``flock(LOCK_EX)``, so they wait
for every save of either kind. Object stores, and filesystems where flock is not known to be local and reliable
(NFS, SMB, FUSE), keep records alone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import time

# Filesystems whose flock is one host's kernel lock table (network filesystems emulate it, or do not).
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "bcachefs",
                               "ramfs", "jfs", "reiserfs", "nilfs2", "hfsplus", "apfs"})
FLOCK_NAME = "flock"  # locks/flock: not named like a lock record, so the record protocol ignores it (§9.2)
_fs_cache: dict[str, str | None] = {}


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (from /proc/self/mountinfo), or None when it cannot be told."""
    path = os.path.realpath(path)
    if path in _fs_cache:
        return _fs_cache[path]
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, right.split()[0]
    except OSError:
        kind = None
    _fs_cache[path] = kind
    return kind


def lock_file_for(root: str) -> str | None:
    """``root/locks/flock`` when ``root`` is on a local filesystem whose flock luopan relies on, else None."""
    if os.environ.get("LUOPAN_LOCK_RECORDS") == "1":  # force the record protocol (tests, odd mounts)
        return None
    return os.path.join(root, "locks", FLOCK_NAME) if filesystem_type(root) in LOCAL_FILESYSTEMS else None


class FileLock:
    """A held ``flock`` on a repository's lock file; ``release`` (or the holder's exit) drops it."""

    def __init__(self, fd: int, kind: str, op: str) -> None:
        self.fd, self.kind, self.op = fd, kind, op

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # closing the only descriptor of this open file description drops the lock

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def open_lock_file(path: str) -> int:
    """An fd on the lock file, created when missing. It holds no data and need not be durable: a lock file lost in a
    power cut is created again by the next locker (every holder of the old one is gone with the power)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def try_flock(path: str, kind: str, op: str, deadline: float | None) -> FileLock | None:
    """Take ``flock`` (shared or exclusive) on ``path``, waiting until ``deadline`` (monotonic; None: forever).
    None when the deadline passed first. OSError when the lock file cannot be opened (callers fall back to
    records)."""
    fd = open_lock_file(path)
    how = fcntl.LOCK_SH if kind == "shared" else fcntl.LOCK_EX
    pause = 0.005
    try:
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                return FileLock(fd, kind, op)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
            if deadline is not None and time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(pause * (0.5 + random.random()))
            pause = min(pause * 1.5, 0.25)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def flock_holders(path: str) -> list[int]:
    """Pids holding a flock on ``path`` (from /proc/locks), for error messages; [] when unknown."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        parts = line.split()
        if "->" in parts:
            continue  # a waiter, not a holder
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                pids.append(int(parts[4]))
            except ValueError:
                pass
    return pids

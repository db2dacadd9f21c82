"""The local store's temporary files (docs/format.md §10): the name a write is linked into place from, and what
happens to it afterwards. A write holds an exclusive flock on its temp file until it is renamed or linked and closed,
so another process removes only temporaries whose writer is gone. Errors on paths that are already failing are
swallowed (the error being raised matters); a write that is done and cannot tidy up warns (CleanupWarning)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import time
import warnings

from .._process import pid_alive
from ..errors import CleanupWarning
from .walk import TMP_MARK

STALE_TMP_SECONDS = 24 * 3600
FRESH_TMP_SECONDS = 60.0  # an unlocked temp file younger than this may be a writer's between open and flock
HOST = socket.gethostname().replace("-", "_")  # in temp names: <key>.tmp-<host>-<pid>-<random>
_log = logging.getLogger("luopan")


def link_new(tmp: str, path: str) -> bool:
    """Give ``tmp``'s file the name ``path`` if that name is free: False if it is taken."""
    try:
        os.link(tmp, path)  # atomic and never replaces an existing file
    except FileExistsError:
        return False
    except OSError as exc:
        # Filesystems without hard links: exists-check + rename. Not atomic against a second writer of the same key
        # (docs/format.md §10 rule 3); content-addressed keys make that harmless except for manifests, where the
        # last rename wins.
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.lexists(path):
            return False
        os.rename(tmp, path)
    return True


def close_quietly(fd: int) -> None:
    """Close ``fd`` on a path that is already failing: its own error must not mask the one being raised."""
    try:
        os.close(fd)
    except OSError:
        pass


def cleanup_failed(message: str) -> None:
    """A write that is done (or a read that has its bytes) could not tidy up: a warning, never an error."""
    _log.warning("%s", message)
    warnings.warn(message, CleanupWarning, stacklevel=4)


def discard(path: str) -> None:
    """Remove a temp file on a path that is already failing (a leftover is removed later; the error being raised
    matters, not this one)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return False  # no locks on this filesystem: cleanup falls back to pid/age
        raise


def remove_if_abandoned(path: str) -> bool:
    try:  # never follow a link or block on a FIFO: only luopan's own regular temp files are candidates
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return False
    except OSError:
        os.close(fd)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Unlocked: its writer is gone — or has just created it and not yet taken the lock (a window of a few
            # microseconds between open and flock). A young file counts only if its writer's pid is dead here.
            abandoned = abandoned_by_pid_or_age(path, FRESH_TMP_SECONDS)
        except BlockingIOError:
            return False  # a live writer holds it
        except OSError:
            abandoned = abandoned_by_pid_or_age(path)
        if abandoned:
            os.unlink(path)
        return abandoned
    except OSError:  # read-only repository, permissions: leave it
        return False
    finally:
        os.close(fd)


def abandoned_by_pid_or_age(path: str, max_age: float = STALE_TMP_SECONDS) -> bool:
    owner = os.path.basename(path).rsplit(TMP_MARK, 1)[1].split("-")
    try:
        host, pid = owner[0], int(owner[1])
        mtime = os.stat(path).st_mtime
    except (IndexError, ValueError, OSError):
        return False
    return (host == HOST and not pid_alive(pid)) or time.time() - mtime > max_age


IOV_MAX = 1024  # iovecs per writev/pwritev call (Linux's limit)


def write_parts(fd: int, parts: list[memoryview], offset: int | None = None) -> int:
    """Write ``parts`` in order with ``writev`` (at the file position) or ``pwritev`` (at ``offset``), continuing
    short writes; returns the bytes written."""
    parts = [p for p in parts if len(p)]
    done = i = 0
    while i < len(parts):
        batch = parts[i : i + IOV_MAX]
        n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + done)
        done += n
        while batch and n >= len(batch[0]):  # advance past what was written (the call may be short)
            n -= len(batch[0])
            batch.pop(0)
            i += 1
        if batch and n:
            parts[i] = parts[i][n:]
    return done

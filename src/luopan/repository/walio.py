"""The file operations of a log (luopan.repository.wal), one function each, so the crash simulation of the tests can
record and fail them (they are bound into wal's namespace: patch ``wal._write`` and friends), and the luopan error
an OSError of a log becomes."""

from __future__ import annotations

import errno
import os

from ..errors import StorageError, StorageFullError, os_remedy


def _write(fd: int, data: bytes, path: str) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _sync(fd: int, path: str) -> None:
    os.fdatasync(fd)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdir(path: str) -> None:
    os.mkdir(path)


def _unlink(path: str) -> None:
    os.unlink(path)


def _truncate(fd: int, size: int, path: str) -> None:
    """Cut a segment back to ``size`` bytes, durably (what a failed append wrote must not come back)."""
    os.ftruncate(fd, size)
    os.fdatasync(fd)


def _put_mark(fd: int, data: bytes, path: str) -> None:
    """Overwrite the sync mark in place (never synced: any version of it that survives was true when written)."""
    os.pwrite(fd, data, 0)


def io_error(exc: OSError, path: str, doing: str, fix: str | None = None) -> StorageError:
    """A luopan error for an OSError met while ``doing`` something to ``path`` of a log: StorageFullError on a full
    disk or quota, StorageError otherwise, naming the file, the system's reason and ``fix`` (by default: the log is
    as it was before the call, so free space or check the disk and try again). ``{remedy}`` in ``fix`` becomes what
    the errno calls for: free space, check the permissions, or check the disk."""
    if isinstance(exc, StorageError):
        return exc
    code = exc.errno or errno.EIO
    why = exc.strerror or str(exc)
    full = code in (errno.ENOSPC, errno.EDQUOT)
    remedy = os_remedy(code)
    if fix is None:
        fix = "the log is as it was before this call: {remedy}, then " + ("append again" if full else "try again")
    cls = StorageFullError if full else StorageError
    what = "no space left" if full else "I/O error" if code == errno.EIO else "failed"
    err = cls(code, f"{what} {doing} {path} ({why}): " + fix.replace("{remedy}", remedy))
    return err


__all__ = ["_mkdir", "_put_mark", "_sync", "_sync_dir", "_truncate", "_unlink", "_write", "io_error"]

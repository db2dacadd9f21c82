"""Small files outside the repository replaced atomically: a temporary file in the same directory, fsync, rename,
fsync of the directory. Failures are luopan errors naming the file (StorageFullError on a full disk, OutputPathError
otherwise). Used for channel files, Lightning pointers, adapter configs and public keys."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable

from .errors import LuopanError, OutputPathError, StorageFullError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomic(path: str | os.PathLike[str], fill: Callable[[int], None]) -> None:
    """Replace ``path`` with what ``fill(fd)`` writes into a new temporary file beside it: readers see the old file
    or the whole new one, never a part; durable on return (fsync of the file, rename, fsync of the directory)."""
    where = os.fspath(path)
    tmp = f"{where}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fill(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, where)
        fsync_dir(os.path.dirname(os.path.abspath(where)))
    except BaseException as exc:
        _unlink(tmp)
        raise write_error(exc, where) from None


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (``replace_atomic``)."""
    def fill(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    replace_atomic(path, fill)


def write_error(exc: BaseException, path: str) -> BaseException:
    """A luopan error for a failure writing ``path`` (other exceptions pass through)."""
    if isinstance(exc, LuopanError) or not isinstance(exc, OSError):
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(exc.errno, f"no space left while writing {path}")
    return OutputPathError(exc.errno or errno.EIO, f"cannot write {path}: {exc.strerror or exc}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

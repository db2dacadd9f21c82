"""Local files of a channel and of a device: small files replaced atomically (a temporary file in the same
directory, fsync, rename, fsync of the directory), moving a finished file into place, and the channel's publish
lock. Failures are luopan errors naming the file (StorageFullError on a full disk, OutputPathError otherwise)."""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

import blake3

from .._files import _unlink, fsync_dir, replace_atomic, write_atomic, write_error  # noqa: F401  (this module's API)
from ..errors import LockedError

LOCK_NAME = ".publish.lock"


def copy_atomic(src: str, dst: str) -> None:
    """Replace ``dst`` with a copy of the file ``src`` (``replace_atomic``): ``dst`` is the old file or the whole
    copy, never a part."""
    try:
        f_in = open(src, "rb")  # noqa: SIM115 - closed below, after replace_atomic used it
    except OSError as exc:
        raise write_error(exc, dst) from None
    with f_in:
        def fill(fd: int) -> None:
            size, done = os.fstat(f_in.fileno()).st_size, 0
            while done < size:
                n = os.sendfile(fd, f_in.fileno(), done, min(size - done, 1 << 30))
                if n == 0:
                    raise OSError(errno.EIO, f"{src} shrank while it was copied")
                done += n

        replace_atomic(dst, fill)


def move_into_place(src: str, dst: str) -> None:
    """Rename the finished (fsynced) file ``src`` to ``dst`` in the same directory, durably."""
    try:
        os.replace(src, dst)
        fsync_dir(os.path.dirname(os.path.abspath(dst)))
    except OSError as exc:
        raise write_error(exc, dst) from None


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_blake3(path: str) -> tuple[int, str]:
    """(size, BLAKE3 hex) of a file, hashed on every core."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    return os.path.getsize(path), h.hexdigest()


@contextmanager
def publish_lock(channel_dir: str) -> Iterator[None]:
    """Hold the channel's publish lock (an flock on ``.publish.lock``): one publish at a time per channel, so two
    never both write version N + 1. LockedError at once when another publish holds it."""
    path = os.path.join(channel_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise write_error(exc, path) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(f"another `luopan publish` is writing the channel {channel_dir} (it holds {path}); "
                              "wait for it to finish") from None
        yield
    finally:
        os.close(fd)

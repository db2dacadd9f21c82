"""Local files of a channel and of a device: small files replaced atomically (a temporary file in the same
directory, fsync, rename, fsync of the directory), moving a finished file into place, and the channel's publish
lock, and the publisher's private scratch directory. Failures are luopan errors naming the file (StorageFullError on
a full disk, OutputPathError otherwise)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import blake3

from .._files import (  # noqa: F401  (this module's API)
    PATH_ERRNOS,
    _unlink,
    fsync_dir,
    replace_atomic,
    sync_placed,
    write_atomic,
    write_error,
)
from ..errors import IntegrityError, LockedError, StorageError, StorageFullError, UsageError

LOCK_NAME = ".publish.lock"  # an older luopan's lock file: no longer made, only locked while present (publish_lock)


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
    except OSError as exc:
        raise write_error(exc, dst, "it is unchanged") from None
    sync_placed(dst)


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
    """Hold the channel's publish lock: an exclusive ``flock`` on the channel directory itself, opened without
    following a link. One publish at a time per channel, so two never both write version N + 1; LockedError at once
    when another publish holds it. No lock file is made: nothing but published files is ever in the served tree.
    A ``.publish.lock`` an older luopan left in the channel is locked too while it is there (so a publisher of that
    version running now is kept out), never created, and never followed when it is a link."""
    try:
        fd = os.open(channel_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise write_error(exc, channel_dir) from None
    held = [fd]
    try:
        _lock_exclusive(fd, channel_dir, channel_dir)
        try:
            held.append(os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise write_error(exc, os.path.join(channel_dir, LOCK_NAME)) from None
        else:
            _lock_exclusive(held[-1], channel_dir, os.path.join(channel_dir, LOCK_NAME))
        yield
    finally:
        for f in held:
            os.close(f)


def _lock_exclusive(fd: int, channel_dir: str, what: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LockedError(f"another `luopan publish` is writing the channel {channel_dir} (it holds a lock on "
                          f"{what}); wait for it to finish") from None
    except OSError as exc:  # e.g. a network filesystem that cannot lock a directory
        raise StorageError(f"cannot lock {what} for publishing: {exc.strerror or exc}; publish into a channel "
                           "directory on a local filesystem") from None


def fd_blake3(fd: int) -> tuple[int, str]:
    """(size, BLAKE3 hex) of the file open at ``fd``, hashed on every core: the bytes of that very file, whatever
    its path names meanwhile."""
    size = os.fstat(fd).st_size
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            h.update(mm)
    return size, h.hexdigest()


def real_dir(path: str, what: str) -> None:
    """UsageError unless ``path`` is a directory itself, not a symbolic link to one (nothing is created or deleted
    through a link a neighbour planted)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise UsageError(f"cannot use {what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UsageError(f"{what} {path} is {kind}: luopan writes and deletes only in a real directory; move it "
                         "away (and look at who put it there)")


class Scratch:
    """A private scratch directory this publish created itself (``mkdir`` of a fresh, unpredictable name, mode 0700)
    and holds open: its files are opened, hashed and moved through the directory's descriptor, never through a
    path a neighbour could swap, and it is removed without following any link."""

    def __init__(self, parent_fd: int, parent: str, name: str, fd: int) -> None:
        self.parent_fd, self.parent, self.name, self.fd = parent_fd, parent, name, fd
        self.path = os.path.join(parent, name)

    def file(self, name: str) -> str:
        """The path to hand a writer (export, patch create) for the scratch file ``name``."""
        return os.path.join(self.path, name)

    def open_written(self, name: str) -> int:
        """A read-only descriptor of the file ``name`` a writer just made in this directory: opened through the
        directory's descriptor without following a link, and checked to be a regular file of ours with one link.
        IntegrityError when it is not (the scratch path was swapped while it was written): nothing is published."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise self._swapped(name, exc.strerror or str(exc)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise self._swapped(name, "it is not a regular file of ours with one link")
        return fd

    def sync(self, fd: int, name: str) -> None:
        """fsync the scratch file ``name``, open at ``fd``; a failure is a luopan error naming it."""
        try:
            os.fsync(fd)
        except OSError as exc:
            raise write_error(exc, self.file(name), "nothing was published") from None

    def move(self, name: str, dst: str) -> None:
        """Rename the finished, fsynced scratch file ``name`` (the entry in this very directory) to ``dst``,
        durably."""
        try:
            os.replace(name, dst, src_dir_fd=self.fd)
        except OSError as exc:
            raise write_error(exc, dst, "it is unchanged") from None
        sync_placed(dst)

    def remove(self) -> None:
        """Delete the directory and everything in it, following no link."""
        try:
            empty_dir(self.fd)
            os.rmdir(self.name, dir_fd=self.parent_fd)
        except OSError:
            pass  # a leftover is removed by the next publish
        finally:
            os.close(self.fd)
            os.close(self.parent_fd)

    def _swapped(self, name: str, why: str) -> IntegrityError:
        return IntegrityError(
            f"the scratch file {self.file(name)} luopan wrote cannot be read back from the directory it created "
            f"({why}): its path was changed while publishing, perhaps by someone with write access to "
            f"{self.parent}'s parent. Nothing was published; make that directory writable by you alone")


def empty_dir(dir_fd: int) -> None:
    """Delete every entry of the directory open at ``dir_fd`` without following links: a link is unlinked itself,
    a directory is removed with the descriptor-based ``shutil.rmtree`` (which never follows a link either)."""
    for entry in os.listdir(dir_fd):
        st = os.lstat(entry, dir_fd=dir_fd)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(entry, dir_fd=dir_fd)
        else:
            os.unlink(entry, dir_fd=dir_fd)


def make_scratch(candidates: list[tuple[str, str]], device: int) -> Scratch:
    """A fresh Scratch in the first usable ``(parent, container)`` of ``candidates``: ``container`` (created mode
    0700 when missing) must be a directory of ours on file system ``device`` — opened without following a link —
    and only we may write in it; its leftovers (of publishes that were interrupted) are removed, then a directory of
    a fresh random name is made inside. When none is usable: UsageError naming each refusal, or, when the disk
    refused every one (full: StorageFullError; an I/O error: StorageError), that error."""
    refused, codes = [], []
    for parent, container in candidates:
        where = os.path.join(parent, container)
        try:
            pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            refused.append(f"{parent}: {exc.strerror or exc}")
            codes.append(exc.errno)
            continue
        try:
            cfd = _open_container(pfd, container, where, device)
        except OSError as exc:
            os.close(pfd)
            refused.append(f"{where}: {exc.strerror or exc}")
            codes.append(exc.errno)
            continue
        try:
            empty_dir(cfd)
            name = f"publish-{secrets.token_hex(12)}"
            os.mkdir(name, 0o700, dir_fd=cfd)  # never follows a link: fails if anything has the name
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cfd)
        except OSError as exc:
            os.close(cfd)
            os.close(pfd)
            refused.append(f"{where}: {exc.strerror or exc}")
            codes.append(exc.errno)
            continue
        os.close(pfd)
        return Scratch(cfd, where, name, fd)
    found = "publish found no private scratch directory it could use: " + "; ".join(refused)
    if codes and all(c in (errno.ENOSPC, errno.EDQUOT) for c in codes):
        raise StorageFullError(codes[0], f"{found}. Free space on that disk (or raise the quota), then publish again")
    if codes and not any(c in PATH_ERRNOS or c is None for c in codes):  # the disk failed, not the paths
        raise StorageError(codes[0], f"{found}. Check the disk (the system log names the device's errors), then "
                           "publish again")
    raise UsageError(f"{found}. Remove what is in the way (a link or a directory of another user), or make the "
                     "channel's parent directory writable by you")


def _open_container(pfd: int, container: str, where: str, device: int) -> int:
    """The descriptor of the scratch container ``container`` under ``pfd`` (created when missing); OSError when it
    is a link, not a directory, not ours, or on another file system (a rename must move files into place)."""
    try:
        os.mkdir(container, 0o700, dir_fd=pfd)
    except FileExistsError:
        pass
    fd = os.open(container, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    st = os.fstat(fd)
    why = ("it belongs to another user" if st.st_uid != os.geteuid() else
           "it is on another file system than the channel" if st.st_dev != device else None)
    if why is not None:
        os.close(fd)
        raise OSError(errno.EPERM, why)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o700)  # ours: nobody else may rename what is inside
    return fd

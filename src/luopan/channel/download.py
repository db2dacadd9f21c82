"""Resumable downloads of channel files (docs/format.md §15.4): into a partial file next to the output, named by
the output and the file's BLAKE3, so a rerun after a cut finds it and asks only for the rest (HTTP Range). The
partial file is checked against the size and BLAKE3 the signed index gives when it is complete; a mismatch, or a
server whose file is not the size the index says, deletes it (CorruptDownloadError). A server that ignores the
range restarts the partial file from zero.

The partial file is opened without following a symbolic link and must be a regular file with one link, owned by
this user (a file someone else planted in a shared directory is refused, never written through), and is locked
(``flock``) for as long as the caller holds it — through the install, until the output is in place — so two pulls
into one output never interleave and a cleanup never deletes a download in progress.

Bytes are written with ``pwrite`` as they arrive (no user-space buffer), so a process killed mid-download leaves
every byte it received in the partial file; after a power loss the tail may be lost or zeroed, which the final
BLAKE3 check catches: a file completed from resumed bytes that does not match is downloaded once more from zero in
the same call, and only a fresh download that does not match is the server's fault (CorruptDownloadError).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3

from ..errors import ChannelDownloadError, CorruptDownloadError, LockedError, OutputPathError
from .files import write_error
from .index import FileRef
from .source import Source, retryable

PIECE = 1 << 20  # bytes per read from the network and per write
APPLIED = ".new"  # suffix (after the partial file's name stem) of a patch's output before it is checked and moved


@dataclass(frozen=True)
class Downloaded:
    path: str  # the complete, verified partial file
    downloaded: int  # bytes received by this call
    resumed_from: int  # bytes already in the partial file when this call began
    restarts: int  # times the server ignored the range, so the partial file started over


def partial_path(out_path: str, ref: FileRef) -> str:
    """Where ``ref`` is downloaded for ``out_path``: a hidden file beside it, e.g. ``.new.safetensors.1a2b….part``."""
    d, base = os.path.split(os.path.abspath(out_path))
    return os.path.join(d, f".{base}.{ref.blake3[:16]}.part")


def applied_path(partial: str) -> str:
    """Where a downloaded patch's output is written before it is checked and renamed onto the output."""
    return partial[: -len(".part")] + APPLIED


class Partial:
    """An open, locked partial file (open_partial); ``close()`` releases the lock."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    def remove(self) -> None:
        """Delete the partial file (its lock is still held, so no other pull is using it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Partial:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_partial(path: str, what: str) -> Partial:
    """Open (creating it) and lock the partial file at ``path``, downloading ``what``. OutputPathError when it is a
    symbolic link, not a regular file, has other links or belongs to another user; LockedError when another pull
    holds it."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OutputPathError(errno.ELOOP, f"the partial file {path} is a symbolic link: refused (a pull "
                                                   "never writes through a link); remove it") from None
            raise write_error(exc, path) from None
        try:
            st = os.fstat(fd)
            problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
                       f"has {st.st_nlink} links (a hard link to another file)" if st.st_nlink != 1 else
                       f"belongs to user {st.st_uid}, not to this one ({os.geteuid()})"
                       if st.st_uid != os.geteuid() else None)
            if problem is not None:
                raise OutputPathError(errno.EPERM, f"the partial file {path} {problem}: refused, nothing written to "
                                                   "it; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd is closed
            except BlockingIOError:
                raise LockedError(f"another pull is downloading {what} into {path}; wait for it to finish") \
                    from None
            os.set_blocking(fd, True)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return Partial(path, fd)
            # a cleanup deleted it between our open and our lock: open the path again
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise LockedError(f"the partial file {path} keeps being replaced while it is opened; is another pull running?")


def remove_stale_partials(out_path: str, keep: str | None = None) -> list[str]:
    """Delete the partial files of ``out_path`` (exactly ``.<name>.<16 hex>.part``, and a patch's unfinished
    output ``.<name>.<16 hex>.new``) other than ``keep``: downloads of files no index names now. One another pull
    holds (locked) is left alone, as is anything that is not this user's regular file."""
    d, base = os.path.split(os.path.abspath(out_path))
    pattern = re.compile(rf"\.{re.escape(base)}\.([0-9a-f]{{16}})\.part")
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None and name.endswith(APPLIED):
            m = pattern.fullmatch(name[: -len(APPLIED)] + ".part")
            if m is not None and (name[: -len(APPLIED)] + ".part") not in names:
                removed += _remove_if_ours(os.path.join(d, name), None)  # the download itself is gone
            continue
        path = os.path.join(d, name)
        if m is None or path == keep:
            continue
        removed += _remove_if_ours(path, applied_path(path))
    return removed


def _remove_if_ours(path: str, also: str | None) -> list[str]:
    """Delete ``path`` (and then ``also``) under ``path``'s lock, if it is this user's unlocked regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    removed = []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # another pull is using it
        for p in (path, also):
            if p is None:
                continue
            try:
                now = os.stat(p, follow_symlinks=False)
                if p == path and (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    return removed
                if stat.S_ISREG(now.st_mode) and now.st_uid == os.geteuid():
                    os.unlink(p)
                    removed.append(p)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return removed


def download(source: Source, ref: FileRef, partial: Partial | str, *, retries: int = 0, backoff: float = 1.0,
             progress: Callable[[int, int], Any] | None = None) -> Downloaded:
    """Complete the partial file (a Partial from open_partial, whose lock the caller keeps; or a path, opened and
    locked for this call) as a copy of ``ref`` from ``source`` and verify it (module docstring).

    A cut, timeout or server error is retried ``retries`` times (after ``backoff`` seconds, doubling), each time
    from where it stopped; then ChannelDownloadError, the partial file kept (at once when a retry cannot help:
    ``retryable`` false). CorruptDownloadError (the partial file deleted) when the bytes, or the size the server
    gives, are not the file the index names. ``progress(done, total)`` follows the file's bytes.
    """
    if isinstance(partial, str):
        with open_partial(partial, ref.name) as part:
            return download(source, ref, part, retries=retries, backoff=backoff, progress=progress)
    fd, path = partial.fd, partial.path
    hasher, have = _resume(fd, ref.size)
    start, got, restarts, attempt = have, 0, 0, 0
    if progress is not None:
        progress(have, ref.size)
    try:
        while have < ref.size:
            try:
                body = source.open(ref.name, have, ref.size)
                try:
                    if body.start != have:  # the server sent the whole file: start over
                        os.ftruncate(fd, 0)
                        hasher, have, restarts = _hasher(), 0, restarts + 1
                    while have < ref.size:
                        data = body.read(min(PIECE, ref.size - have))
                        if not data:
                            raise ChannelDownloadError(f"{ref.name}: the server ended the transfer after {have} of "
                                                       f"{ref.size} bytes; run the pull again to resume")
                        _write_all(fd, data, have, path)
                        hasher.update(data)
                        have += len(data)
                        got += len(data)
                        if progress is not None:
                            progress(have, ref.size)
                finally:
                    body.close()
            except ChannelDownloadError as exc:
                if not retryable(exc) or attempt >= retries:
                    raise
                time.sleep(min(backoff * 2**attempt, 30.0))
                attempt += 1
        try:
            os.fsync(fd)
        except OSError as exc:
            # not kept: after a failed fsync the kernel may mark the lost pages clean, so a rerun would hash the page
            # cache, not the disk, and trust bytes that a power loss can still take (a failed sync is never retried
            # and trusted, docs/format.md §10.6)
            partial.remove()
            raise write_error(exc, path, "the partial file was deleted; a rerun downloads it anew") from None
    except CorruptDownloadError as exc:
        partial.remove()
        raise CorruptDownloadError(f"{exc}; the partial file was deleted (run the pull again to download it anew "
                                   "once the server is fixed)") from None
    if hasher.hexdigest() != ref.blake3 and start and not restarts:
        # the first ``start`` bytes were the partial file's, which a power loss may have cut or zeroed in place (a
        # rerun after one would fail once more): download the file once more from zero before blaming the server
        # (not when the server already sent the whole file from zero: those bytes were all its own)
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:
            partial.remove()
            raise write_error(exc, path, "the partial file was deleted; a rerun downloads it anew") from None
        again = download(source, ref, partial, retries=retries, backoff=backoff, progress=progress)
        return Downloaded(path, got + again.downloaded, start, restarts + again.restarts)
    if hasher.hexdigest() != ref.blake3:
        partial.remove()
        raise CorruptDownloadError(f"{ref.name}: the {ref.size} bytes downloaded have BLAKE3 {hasher.hexdigest()}, "
                                   f"not {ref.blake3} as the signed index says; the partial file was deleted (run "
                                   "the pull again to download it anew)")
    return Downloaded(path, got, start, restarts)


def _resume(fd: int, size: int) -> tuple[Any, int]:
    """The hash of the bytes already in the partial file and their count (a longer file starts over)."""
    have = os.fstat(fd).st_size
    hasher = _hasher()
    if have > size:
        os.ftruncate(fd, 0)
        return hasher, 0
    done = 0
    while done < have:
        data = os.pread(fd, min(PIECE * 8, have - done), done)
        if not data:
            break
        hasher.update(data)
        done += len(data)
    os.ftruncate(fd, done)
    return hasher, done


def _hasher() -> Any:
    return blake3.blake3(max_threads=blake3.blake3.AUTO)  # a resumed partial file is hashed on every core


def _write_all(fd: int, data: bytes, offset: int, path: str) -> None:
    view = memoryview(data)
    try:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    except OSError as exc:
        raise write_error(exc, path, "the bytes downloaded before are kept, and a rerun resumes") from None

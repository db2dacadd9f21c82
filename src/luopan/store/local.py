"""Local filesystem store with the atomic-write rules of docs/format.md §10.

Every write: temp file in the destination directory → write → fsync(file) → rename (``put``) or no-replace hard
link (``put_if_absent``) → fsync(directory). Temp names carry host and pid so that ``cleanup_temporaries`` removes
only leftovers of dead writers, never a live writer's file.

Listing goes through luopan.store.walk, which follows symbolic links everywhere (docs/format.md §2). Only regular
files are objects: a FIFO, socket or device is never opened for reading (``_open_regular``).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from .._crash import crashpoint
from ..errors import LuopanError, StorageError, StorageFullError, os_remedy
from .base import Data, KeyNotFound, Store, Stray, as_parts, check_key, too_large, valid_key
from .tempfiles import HOST as _HOST
from .tempfiles import STALE_TMP_SECONDS as STALE_TMP_SECONDS  # doctor's leftovers check reads it here
from .tempfiles import (cleanup_failed, close_quietly, discard, link_new, remove_if_abandoned, try_lock, unlink_quietly,
                        write_parts)
from .walk import ABSENT as _ABSENT
from .flocks import lock_file_for
from .localstream import LocalStream
from .walk import TMP_MARK, file_kind as _kind, list_dir, walk

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _crash_kind(key: str) -> str:
    top = key.split("/", 1)[0]
    return {"packs": "pack", "index": "index", "runs": "manifest", "artifacts": "manifest", "refs": "ref"}.get(top, "file")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._dirs: set[str] = set()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _failed(self, exc: OSError, op: str, key: str) -> OSError:
        """The typed error for an OSError of ``op`` ("read", "write", "delete", "list") on ``key``."""
        if isinstance(exc, LuopanError):
            return exc
        if exc.errno in _FULL_ERRNOS:
            return self._full(exc, self._path(key) if valid_key(key) else self.root)
        if exc.errno == errno.EROFS:
            return StorageError(exc.errno, f"{self.root} is on a read-only filesystem: cannot {op} {key}. Commands "
                                "that only read (ls, show, verify, export, load) work; save, prune, gc, pin and "
                                "unlock need it mounted read-write")
        if exc.errno in (errno.EACCES, errno.EPERM):
            need = "read" if op in ("read", "list") else "write to"
            return StorageError(exc.errno, f"permission denied: cannot {op} {key} in {self.root}: this user may not "
                                f"{need} it; check the owner and mode of the repository's files and directories")
        return StorageError(exc.errno or errno.EIO, f"cannot {op} {key} in {self.root}: "
                            f"{exc.strerror or exc}; {os_remedy(exc.errno or errno.EIO)}, then try again")

    def _open_regular(self, key: str) -> int:
        """An fd open for reading on ``key``, which must be a regular file (followed through symlinks). Anything
        else is KeyNotFound, checked before opening and again on the fd, so a FIFO is never opened to block."""
        path = self._path(key)
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise KeyNotFound(f"{key} ({_kind(st.st_mode)})")
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except _ABSENT:
            raise KeyNotFound(key) from None
        except OSError as exc:
            if isinstance(exc, KeyNotFound):
                raise
            raise self._failed(exc, "read", key) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between stat and open
                raise KeyNotFound(f"{key} (not a regular file)")
        except OSError as exc:
            close_quietly(fd)
            if isinstance(exc, KeyNotFound):
                raise
            raise self._failed(exc, "read", key) from None
        except BaseException:
            close_quietly(fd)
            raise
        return fd

    def _stat_regular(self, key: str) -> os.stat_result:
        try:
            st = os.stat(self._path(key))
        except _ABSENT:
            raise KeyNotFound(key) from None
        except OSError as exc:
            raise self._failed(exc, "read", key) from None
        if not stat.S_ISREG(st.st_mode):
            raise KeyNotFound(f"{key} ({_kind(st.st_mode)})")
        return st

    def _ensure_dir(self, d: str) -> None:
        if d in self._dirs:
            return
        if not os.path.isdir(d):
            parent = os.path.dirname(d)
            self._ensure_dir(parent)
            try:
                os.mkdir(d)
            except FileExistsError:
                pass
            else:
                _fsync_dir(parent)  # the new directory entry must survive a crash too
        self._dirs.add(d)

    def _write_temp(self, path: str, data: Data, kind: str) -> tuple[str, int]:
        """Write ``data`` to a new locked temp file beside ``path`` and fsync it. Returns (temp path, open fd).

        The fd holds an exclusive flock until the caller has renamed/linked the file and closes it: cleanup in
        another process deletes a temp file only if it can take that lock, i.e. only if its writer is gone.
        """
        self._ensure_dir(os.path.dirname(path))
        tmp = f"{path}{TMP_MARK}{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try_lock(fd)
            write_parts(fd, as_parts(data))
            crashpoint(f"{kind}.written")
            os.fsync(fd)
            crashpoint(f"{kind}.fsynced")
        except BaseException:
            close_quietly(fd)  # never mask the error that got us here
            discard(tmp)
            raise
        return tmp, fd

    def _full(self, exc: OSError, path: str) -> OSError:
        """StorageFullError for out-of-space (blocks, inodes, quota) at any step of a write; else ``exc``."""
        if exc.errno in _FULL_ERRNOS and not isinstance(exc, StorageFullError):
            return StorageFullError(
                exc.errno,
                f"no space left on {self.root!r} while writing {os.path.relpath(path, self.root)}: the write was not "
                "committed; free space (e.g. delete old checkpoints, then run gc) and try again",
            )
        return exc

    def _sync_placed(self, path: str, key: str) -> None:
        """Sync the directory of ``key``, just renamed or linked into place: on failure the new name is visible but
        may not survive a power loss, which the error says (a typed error naming the key; try again)."""
        try:
            _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            full = exc.errno in _FULL_ERRNOS
            cls = StorageFullError if full else StorageError
            raise cls(exc.errno or errno.EIO, f"{key} was written in {self.root}, but syncing its directory failed "
                      f"({exc.strerror or exc}): it may not survive a power loss; "
                      + ("free space (e.g. delete old checkpoints, then run gc) and try again" if full else
                         f"{os_remedy(exc.errno or errno.EIO)}, then try again")) from None

    def _close_after(self, fd: int, key: str, doing: str) -> None:
        """Close ``fd`` once ``key``'s read or write is done: an error now changes nothing (a write's bytes were
        synced before its rename), so it is a CleanupWarning naming the file, not a failed operation."""
        try:
            os.close(fd)
        except OSError as exc:
            cleanup_failed(f"closing {self._path(key)} after {doing} it failed ({exc.strerror or exc}); the "
                            f"{'read' if doing == 'reading' else 'write'} itself succeeded")

    def _unlink_after(self, tmp: str, key: str) -> None:
        """Remove the temp name of a write of ``key`` that is done (or lost a race): a failure leaves a stray temp
        file, which cleanup of gone writers' temporaries removes later (a CleanupWarning naming it)."""
        try:
            unlink_quietly(tmp)
        except OSError as exc:
            cleanup_failed(f"could not remove the temporary file {tmp} after writing {key} "
                            f"({exc.strerror or exc}); the write itself succeeded, and the file is removed later "
                            "as a leftover")

    # -- primitives ---------------------------------------------------------------------------------------------
    @contextmanager
    def _mapping(self, op: str, key: str) -> Iterator[None]:
        """OSErrors of ``op`` on ``key`` raised as typed errors (StorageError, StorageFullError)."""
        try:
            yield
        except OSError as exc:
            failed = self._failed(exc, op, key)
            if failed is exc:
                raise
            raise failed from exc

    @contextmanager
    def _reading(self, key: str) -> Iterator[int]:
        """An fd open for reading on the regular file ``key``; OSErrors become typed errors; always closed."""
        fd = self._open_regular(key)
        try:
            with self._mapping("read", key):
                yield fd
        finally:
            self._close_after(fd, key, "reading")

    def get(self, key: str) -> bytes:
        with self._reading(key) as fd, os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()

    def get_limited(self, key: str, limit: int) -> bytes:
        with self._reading(key) as fd:
            size = os.fstat(fd).st_size
            if size > limit:
                raise too_large(key, size, limit, self.root)
            with os.fdopen(fd, "rb", closefd=False) as f:
                parts = [f.read(size + 1)]  # read(n) allocates n up front: the real size, never the limit
                total = len(parts[0])
                while size < total <= limit:  # it grew after the fstat: read on, in bounded pieces
                    more = f.read(min(64 << 20, limit + 1 - total))
                    if not more:
                        break
                    parts.append(more)
                    total += len(more)
        if total > limit:
            raise too_large(key, total, limit, self.root)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with self._reading(key) as fd:
            return os.pread(fd, length, offset)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        with self._reading(key) as fd:
            got = 0
            while got < len(out):
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return got

    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        kind = _crash_kind(key)
        with self._mapping("write", key):
            tmp, fd = self._write_temp(path, data, kind)
            try:
                os.replace(tmp, path)
            except BaseException:
                close_quietly(fd)
                discard(tmp)
                raise
            self._close_after(fd, key, "writing")  # written and synced: a close error changes nothing on disk
            crashpoint(f"{kind}.renamed")
            self._sync_placed(path, key)
            crashpoint(f"{kind}.dirsynced")

    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        if os.path.lexists(path):
            return False
        kind = _crash_kind(key)
        with self._mapping("write", key):
            tmp, fd = self._write_temp(path, data, kind)
            try:
                linked = link_new(tmp, path)
                if linked:
                    crashpoint(f"{kind}.renamed")
            except BaseException:
                close_quietly(fd)
                discard(tmp)
                raise
            # Linked or not, the temp name goes. Once linked the key holds the data (synced before the link; the
            # directory sync below makes it durable): failing to remove the temp name or to close it is cleanup,
            # never a failed write.
            self._unlink_after(tmp, key)
            self._close_after(fd, key, "writing")
            if not linked:
                return False
            self._sync_placed(path, key)
            crashpoint(f"{kind}.dirsynced")
            return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._mapping("delete", key):
            try:
                os.unlink(path)
            except _ABSENT:
                return
            _fsync_dir(os.path.dirname(path))

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, stray in walk(self.root, prefix):
            if stray is None:
                yield key

    def list_flat(self, prefix: str) -> list[str]:
        try:
            return list_dir(self.root, prefix)
        except OSError as exc:
            raise self._failed(exc, "list", prefix) from None

    def list_with_strays(self, prefix: str = "") -> tuple[list[str], list[Stray]]:
        keys: list[str] = []
        strays: list[Stray] = []
        for key, stray in walk(self.root, prefix):
            if stray is None:
                keys.append(key)
            else:
                strays.append(stray)
        return keys, strays

    def strays(self, prefix: str = "") -> list[Stray]:
        return [stray for _key, stray in walk(self.root, prefix) if stray is not None]

    def exists(self, key: str) -> bool:
        try:
            self._stat_regular(key)
        except KeyNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        return self._stat_regular(key).st_size

    def signature(self, key: str) -> tuple[int, ...] | None:
        st = self._stat_regular(key)
        return (st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)

    def modified(self, key: str) -> float | None:
        return self._stat_regular(key).st_mtime

    def free_bytes(self) -> int | None:
        path = self.root
        while not os.path.isdir(path):  # a repository being created: the disk it will live on
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        try:
            st = os.statvfs(path)
        except OSError:
            return None  # unknown (base.Store.free_bytes): a write that then fails says why, naming its file
        return st.f_bavail * st.f_frsize

    # -- conveniences -------------------------------------------------------------------------------------------
    def cleanup_temporaries(self) -> int:
        """Remove temp files whose writer is gone: ones whose flock can be taken (a live writer holds it until its
        rename), or, where the filesystem has no locks, ones of a dead pid on this host or older than a day.
        Never fails: a read-only repository or an unremovable file is left as it is."""
        removed = 0
        for path, stray in walk(self.root, "", temporaries=True):
            if stray is None and TMP_MARK in os.path.basename(path) and remove_if_abandoned(path):
                removed += 1
        return removed

    def lock_path(self) -> str | None:
        return lock_file_for(self.root)

    def open_stream(self, directory: str) -> LocalStream:
        return LocalStream(self, directory, _crash_kind(directory + "/x"))

    def describe(self) -> str:
        return self.root

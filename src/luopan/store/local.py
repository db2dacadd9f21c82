"""Local filesystem store with the atomic-write rules of docs/format.md §10.

Every write: temp file in the destination directory → write → fsync(file) → rename (``put``) or no-replace hard
link (``put_if_absent``) → fsync(directory). Temp names carry host and pid so that ``cleanup_temporaries`` removes
only leftovers of dead writers, never a live writer's file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import time
from collections.abc import Iterator

from .._crash import crashpoint
from ..errors import StorageFullError
from .base import Data, KeyNotFound, Store, as_parts

TMP_MARK = ".tmp-"
STALE_TMP_SECONDS = 24 * 3600
FRESH_TMP_SECONDS = 60.0  # an unlocked temp file younger than this may be a writer's between open and flock
_IOV_MAX = 1024
_HOST = socket.gethostname().replace("-", "_")
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _crash_kind(key: str) -> str:
    top = key.split("/", 1)[0]
    return {"packs": "pack", "index": "index", "runs": "manifest", "refs": "ref"}.get(top, "file")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._dirs: set[str] = set()

    # -- helpers ------------------------------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if not key or key.startswith("/") or "\\" in key or "\0" in key or ".." in key.split("/"):
            raise ValueError(f"invalid store key {key!r}")
        return os.path.join(self.root, *key.split("/"))

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
            _try_lock(fd)
            parts = as_parts(data)
            i = 0
            while i < len(parts):
                batch = parts[i : i + _IOV_MAX]
                n = os.writev(fd, batch)
                # advance past what was written (writev may be short)
                while batch and n >= len(batch[0]):
                    n -= len(batch[0])
                    batch.pop(0)
                    i += 1
                if batch and n:
                    parts[i] = parts[i][n:]
            crashpoint(f"{kind}.written")
            os.fsync(fd)
            crashpoint(f"{kind}.fsynced")
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        return tmp, fd

    def _full(self, exc: OSError, path: str) -> OSError:
        """StorageFullError for out-of-space (blocks, inodes, quota) at any step of a write; else ``exc``."""
        if exc.errno in _FULL_ERRNOS and not isinstance(exc, StorageFullError):
            return StorageFullError(
                exc.errno,
                f"no space left on {self.root!r} while writing {os.path.basename(path)}: the write was not "
                "committed; free space (e.g. delete old checkpoints) and save again",
            )
        return exc

    # -- primitives ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyNotFound(key) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyNotFound(key) from None
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyNotFound(key) from None
        try:
            got = 0
            while got < len(out):
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        kind = _crash_kind(key)
        try:
            tmp, fd = self._write_temp(path, data, kind)
            try:
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
            finally:
                os.close(fd)
            crashpoint(f"{kind}.renamed")
            _fsync_dir(os.path.dirname(path))
            crashpoint(f"{kind}.dirsynced")
        except OSError as exc:
            full = self._full(exc, path)
            if full is exc:
                raise
            raise full from exc

    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            return False
        kind = _crash_kind(key)
        try:
            tmp, fd = self._write_temp(path, data, kind)
            try:
                try:
                    os.link(tmp, path)  # atomic and never replaces an existing file
                except FileExistsError:
                    return False
                except OSError as exc:
                    # Filesystems without hard links: exists-check + rename. Not atomic against a second writer
                    # of the same key (docs/format.md §10 rule 3); content-addressed keys make that harmless
                    # except for manifests, where the last rename wins.
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                        raise
                    if os.path.exists(path):
                        return False
                    os.rename(tmp, path)
                crashpoint(f"{kind}.renamed")
            finally:
                _unlink_quietly(tmp)
                os.close(fd)
            _fsync_dir(os.path.dirname(path))
            crashpoint(f"{kind}.dirsynced")
            return True
        except OSError as exc:
            full = self._full(exc, path)
            if full is exc:
                raise
            raise full from exc

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        _fsync_dir(os.path.dirname(path))

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not os.path.isdir(base):
            return
        stack = [base]
        while stack:
            d = stack.pop()
            try:
                it = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for e in it:
                if TMP_MARK in e.name:
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    yield os.path.relpath(e.path, self.root).replace(os.sep, "/")

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def size(self, key: str) -> int:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            raise KeyNotFound(key) from None

    def signature(self, key: str) -> tuple[int, ...] | None:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            raise KeyNotFound(key) from None
        return (st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)

    def modified(self, key: str) -> float | None:
        try:
            return os.stat(self._path(key)).st_mtime
        except FileNotFoundError:
            raise KeyNotFound(key) from None

    def free_bytes(self) -> int | None:
        path = self.root
        while not os.path.isdir(path):  # a repository being created: the disk it will live on
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    # -- conveniences -------------------------------------------------------------------------------------------
    def cleanup_temporaries(self) -> int:
        """Remove temp files whose writer is gone: ones whose flock can be taken (a live writer holds it until its
        rename), or, where the filesystem has no locks, ones of a dead pid on this host or older than a day.
        Never fails: a read-only repository or an unremovable file is left as it is."""
        removed = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if TMP_MARK in name and _remove_if_abandoned(os.path.join(dirpath, name)):
                    removed += 1
        return removed

    def describe(self) -> str:
        return self.root


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return False  # no locks on this filesystem: cleanup falls back to pid/age
        raise


def _remove_if_abandoned(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Unlocked: its writer is gone — or has just created it and not yet taken the lock (a window of a few
            # microseconds between open and flock). A young file counts only if its writer's pid is dead here.
            abandoned = _abandoned_by_pid_or_age(path, FRESH_TMP_SECONDS)
        except BlockingIOError:
            return False  # a live writer holds it
        except OSError:
            abandoned = _abandoned_by_pid_or_age(path)
        if abandoned:
            os.unlink(path)
        return abandoned
    except OSError:  # read-only repository, permissions: leave it
        return False
    finally:
        os.close(fd)


def _abandoned_by_pid_or_age(path: str, max_age: float = STALE_TMP_SECONDS) -> bool:
    owner = os.path.basename(path).rsplit(TMP_MARK, 1)[1].split("-")
    try:
        host, pid = owner[0], int(owner[1])
        mtime = os.stat(path).st_mtime
    except (IndexError, ValueError, OSError):
        return False
    return (host == _HOST and not _pid_alive(pid)) or time.time() - mtime > max_age

"""Small files outside the repository replaced atomically: a temporary file in the same directory, fsync, rename,
fsync of the directory. Failures are luopan errors naming the file and what to do (``write_error``: StorageFullError
on a full disk, OutputPathError when the path is the problem, StorageError for an I/O error). Used for channel files,
Lightning pointers, adapter configs and public keys; ``write_error`` for every file luopan writes outside a
repository (exports, patch outputs, checkouts), ``check_output_path`` before such a file is written."""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable

from .errors import LuopanError, OutputPathError, StorageError, StorageFullError, os_remedy

# errors that are about the path itself (where it is, who may write there): the caller chose a bad output
PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                          errno.EEXIST, errno.ELOOP, errno.ENAMETOOLONG, errno.EXDEV})


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike[str], *, mkdir: Callable[[str], None] | None = None,
              sync_dir: Callable[[str], None] | None = None) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates synced into its parent before this returns (a
    directory entry is durable only once its parent is synced: nothing inside may be acknowledged before).
    ``mkdir`` and ``sync_dir`` (default ``os.mkdir`` and ``fsync_dir``) let a caller route the calls through its own
    error handling."""
    mkdir = mkdir or os.mkdir
    sync_dir = sync_dir or fsync_dir
    missing, p = [], os.path.abspath(os.fspath(path))
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
    for d in reversed(missing):
        sync_dir(os.path.dirname(d))


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
    except BaseException as exc:
        _unlink(tmp)
        raise write_error(exc, where, "it is unchanged") from None
    sync_placed(where)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (``replace_atomic``)."""
    def fill(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    replace_atomic(path, fill)


def sync_placed(path: str | os.PathLike[str]) -> None:
    """Sync the directory of ``path``, a file just renamed into place; a failure is ``write_error(placed=True)``."""
    try:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except OSError as exc:
        raise write_error(exc, os.fspath(path), placed=True) from None


def check_output_path(path: str | os.PathLike[str]) -> str:
    """The output path as a str, if a file can be created there: its directory exists and it is not a directory
    (OutputPathError otherwise). Checked before an export or a patch apply reads anything."""
    out = os.fspath(path)
    if not out or os.path.isdir(out):
        raise OutputPathError(21, f"{out or '(empty)'} is a directory: give a file name for the export, e.g. "
                                  f"{os.path.join(out or '.', 'model.safetensors')}")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise OutputPathError(2, f"cannot write {out}: the directory {parent} does not exist; create it first "
                                 f"(mkdir -p {parent})")
    return out


def write_error(exc: BaseException, path: str, outcome: str = "", *, placed: bool = False) -> BaseException:
    """A luopan error for a failure writing ``path``, a file outside any repository (other exceptions pass through):
    StorageFullError on a full disk or quota, OutputPathError when the path itself is the problem (a missing
    directory, permissions, a read-only file system…), StorageError for an I/O error; each names the file and, but
    for a bad path, what to do. ``outcome`` says what became of the file (e.g. "nothing was written"). ``placed``:
    the file was renamed into place and only the sync of its directory failed, so it may not survive a power loss."""
    if isinstance(exc, LuopanError) or not isinstance(exc, OSError):
        return exc
    code = exc.errno or errno.EIO
    why = exc.strerror or str(exc)
    full = code in (errno.ENOSPC, errno.EDQUOT)
    fix = f"{os_remedy(code)}, then try again"
    if placed:
        return (StorageFullError if full else StorageError)(
            code, f"{path} was written, but syncing its directory failed ({why}): it may not survive a power loss; "
            f"{fix}")
    done = f": {outcome}" if outcome else ""
    if full:
        return StorageFullError(code, f"no space left while writing {path}{done}; {fix}")
    if code in PATH_ERRNOS:
        return OutputPathError(code, f"cannot write {path}: {why}" + (f"; {outcome}" if outcome else ""))
    what = "I/O error writing" if code == errno.EIO else "cannot write"
    return StorageError(code, f"{what} {path} ({why}){done}; {fix}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""What an artifact commit stores: the files and directories of a directory, one file, or a {path: bytes} mapping,
with relative paths and modes; anything that cannot be stored as it is (a symbolic link, a device, a FIFO, a socket,
a path escaping the directory, a name the name rule refuses) is refused with an error naming it, before anything is
written. Files are opened later, when their chunks are stored: without following a link and without blocking, and
checked to be the very file that was listed (SourceChangedError otherwise)."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import (
    ArgumentTypeError,
    ArtifactNotFoundError,
    InvalidPathError,
    SourceChangedError,
    StorageError,
    UnsupportedFileError,
)
from ..format.names import show_path
from .manifest import check_relpath
from .ownfiles import OWN_FILES, is_luopans

DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
# A listed path is opened again without following a final symbolic link, without blocking on a FIFO (or a device)
# swapped in since, and without making a terminal the controlling one; what was opened is then checked with fstat.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_OPEN_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RENAME_HINT = ("rename it (letters, digits, '.', '_', '-' and spaces are always safe; '/' separates directories), "
                "then commit again; nothing was written")


@dataclass
class Source:
    """One file to store: its relative path and mode, and where its bytes come from."""

    path: str
    mode: int
    size: int
    fs_path: str | None = None
    data: bytes | memoryview | None = None
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) when listed: the file opened must be this one

    def open(self) -> BinaryIO:
        if self.data is not None:
            return io.BytesIO(self.data)
        assert self.fs_path is not None
        fd = _open_checked(self.fs_path, _OPEN_FLAGS, self.ident, stat.S_ISREG, "regular file")
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # reads block again
            return open(fd, "rb", buffering=0, closefd=True)  # noqa: SIM115 - closed by the caller's with
        except BaseException:
            os.close(fd)
            raise


@dataclass
class Collected:
    root: str  # "dir", "file" or "files"
    files: list[Source]
    dirs: list[tuple[str, int]]  # (relative path, mode) of every directory below the root


def _what(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else "a device"
            if stat.S_ISBLK(mode) or stat.S_ISCHR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a regular file" if stat.S_ISREG(mode) else "not a regular file or directory")


def _refuse(path: str, st: os.stat_result) -> UnsupportedFileError:
    return UnsupportedFileError(f"{show_path(path)} is {_what(st.st_mode)}: artifacts hold regular files and "
                                "directories only; remove it, or copy what it points to into place, then commit again")


def _changed(path: str, now: str) -> SourceChangedError:
    exc = SourceChangedError(f"{show_path(path)} changed while it was being committed: it is now {now}. Nothing was "
                             "committed and no link was followed; commit again once nothing changes it")
    exc.path = path
    return exc


def _open_checked(path: str, flags: int, ident: tuple[int, int] | None, is_kind: Any, kind: str) -> int:
    """``path`` opened with ``flags`` (never following a final link), checked with fstat to be of the kind listed and,
    when ``ident`` is given, the very file listed (same device and inode): SourceChangedError otherwise."""
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is None and exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise _changed(path, "gone") from None
        if (st is not None and not is_kind(st.st_mode)) or exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENXIO):
            raise _changed(path, _what(st.st_mode) if st is not None else "not " + kind) from None
        raise StorageError(exc.errno or 5, f"cannot read {show_path(path)}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not is_kind(st.st_mode):
            raise _changed(path, _what(st.st_mode))
        if ident is not None and (st.st_dev, st.st_ino) != ident:
            raise _changed(path, f"another {kind} (it was replaced, or a directory above it was)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bad_name(path: str, why: str) -> InvalidPathError:
    return InvalidPathError(f"{show_path(path)} cannot be stored in an artifact: its name makes {why}; {_RENAME_HINT}")


def collect(what: Any) -> Collected:
    """The files of ``what``: a directory (walked, symbolic links refused), a file, or a {relpath: bytes} dict."""
    if isinstance(what, Mapping):
        return _from_mapping(what)
    if not isinstance(what, (str, os.PathLike)):
        raise ArgumentTypeError(f"commit takes a directory, a file or a dict of relative path -> bytes, got "
                                f"{type(what).__name__}")
    root = os.fsdecode(os.fspath(what))
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise ArtifactNotFoundError(f"{show_path(root)} does not exist: nothing to commit") from None
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot read {show_path(root)}: {exc.strerror or exc}") from None
    if stat.S_ISREG(st.st_mode):
        name = os.path.basename(root.rstrip(os.sep)) or "file"
        why = check_relpath(name)
        if why is None and is_luopans(name):
            why = OWN_FILES
        if why is not None:
            raise _bad_name(root, why)
        return Collected("file", [Source(name, stat.S_IMODE(st.st_mode), st.st_size, fs_path=root,
                                         ident=(st.st_dev, st.st_ino))], [])
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(root, st)
    files: list[Source] = []
    dirs: list[tuple[str, int]] = []
    todo: list[tuple[str, str, tuple[int, int]]] = [(root, "", (st.st_dev, st.st_ino))]
    while todo:  # depth first, each directory's entries by name
        abs_dir, rel, ident = todo.pop()
        below: list[tuple[str, str, tuple[int, int]]] = []
        for name, est in _list(abs_dir, ident):
            full = os.path.join(abs_dir, name)
            rel_path = f"{rel}/{name}" if rel else name
            if is_luopans(rel_path):  # a checkout's record or temporary file: luopan's, never data
                continue
            why = check_relpath(rel_path)
            if why is not None:
                raise _bad_name(full, why)
            if stat.S_ISDIR(est.st_mode):
                dirs.append((rel_path, stat.S_IMODE(est.st_mode)))
                below.append((full, rel_path, (est.st_dev, est.st_ino)))
            elif stat.S_ISREG(est.st_mode):
                files.append(Source(rel_path, stat.S_IMODE(est.st_mode), est.st_size, fs_path=full,
                                    ident=(est.st_dev, est.st_ino)))
            else:
                raise _refuse(full, est)
        todo.extend(reversed(below))
    return Collected("dir", files, dirs)


def _list(path: str, ident: tuple[int, int]) -> list[tuple[str, os.stat_result]]:
    """The entries of the directory ``path`` by name, each with its lstat, read through a descriptor of the very
    directory that was listed (opened without following a link): a directory swapped for a link since is refused."""
    fd = _open_checked(path, _OPEN_DIR_FLAGS, ident, stat.S_ISDIR, "directory")
    try:
        with os.scandir(fd) as it:
            return sorted(((e.name, e.stat(follow_symlinks=False)) for e in it), key=lambda pair: pair[0])
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot read the directory {show_path(path)}: "
                                           f"{exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _from_mapping(mapping: Mapping[Any, Any]) -> Collected:
    files: list[Source] = []
    dirs: set[str] = set()
    for path, data in mapping.items():
        why = check_relpath(path)
        if why is None and is_luopans(path):
            why = OWN_FILES
        if why is not None:
            raise InvalidPathError(f"{show_path(path)} cannot be stored in an artifact: it is {why}; use relative "
                                   "paths like 'part-0001.jsonl' or 'train/part-0001.jsonl'")
        if isinstance(data, str):
            raise ArgumentTypeError(f"{show_path(path)}: file contents must be bytes, got str (encode it, e.g. "
                                    ".encode())")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"{show_path(path)}: file contents must be bytes, got {type(data).__name__}")
        try:
            view = memoryview(data).cast("B")
        except TypeError:  # a non-contiguous view (a strided NumPy slice): its bytes are not one range
            raise ArgumentTypeError(f"{show_path(path)}: file contents must be contiguous bytes (copy a strided view "
                                    "with bytes(...) first)") from None
        files.append(Source(path, DEFAULT_FILE_MODE, len(view), data=view))
        parts = path.split("/")
        dirs.update("/".join(parts[:k]) for k in range(1, len(parts)))
    clash = sorted(dirs.intersection(f.path for f in files))
    if clash:
        raise UnsupportedFileError(f"{show_path(clash[0])} is given both as a file and as a directory")
    files.sort(key=lambda f: f.path)
    return Collected("files", files, [(d, DEFAULT_DIR_MODE) for d in sorted(dirs)])

"""What an artifact commit stores: the files and directories of a directory, one file, or a {path: bytes} mapping,
with relative paths and modes; anything that cannot be stored as it is (a symbolic link, a device, a FIFO, a socket,
a path escaping the directory) is refused with an error naming it, before anything is written."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import ArgumentTypeError, ArtifactNotFoundError, StorageError, UnsupportedFileError
from .manifest import check_relpath

DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755


@dataclass
class Source:
    """One file to store: its relative path and mode, and where its bytes come from."""

    path: str
    mode: int
    size: int
    fs_path: str | None = None
    data: bytes | memoryview | None = None

    def open(self) -> BinaryIO:
        if self.data is not None:
            return io.BytesIO(self.data)
        assert self.fs_path is not None
        try:
            return open(self.fs_path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller's with
        except OSError as exc:
            raise StorageError(exc.errno or 5, f"cannot read {self.fs_path}: {exc.strerror or exc}") from None


@dataclass
class Collected:
    root: str  # "dir", "file" or "files"
    files: list[Source]
    dirs: list[tuple[str, int]]  # (relative path, mode) of every directory below the root


def _refuse(path: str, st: os.stat_result) -> UnsupportedFileError:
    what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a device" if stat.S_ISBLK(st.st_mode)
            or stat.S_ISCHR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket"
            if stat.S_ISSOCK(st.st_mode) else "not a regular file or directory")
    return UnsupportedFileError(f"{path} is {what}: artifacts hold regular files and directories only; remove it, "
                                "or copy what it points to into place, then commit again")


def collect(what: Any) -> Collected:
    """The files of ``what``: a directory (walked, symbolic links refused), a file, or a {relpath: bytes} dict."""
    if isinstance(what, Mapping):
        return _from_mapping(what)
    if not isinstance(what, (str, os.PathLike)):
        raise ArgumentTypeError(f"commit takes a directory, a file or a dict of relative path -> bytes, got "
                                f"{type(what).__name__}")
    root = os.fspath(what)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise ArtifactNotFoundError(f"{root} does not exist: nothing to commit") from None
    except OSError as exc:
        raise StorageError(exc.errno or 5, f"cannot read {root}: {exc.strerror or exc}") from None
    if stat.S_ISREG(st.st_mode):
        return Collected("file", [Source(os.path.basename(root.rstrip(os.sep)) or "file",
                                         stat.S_IMODE(st.st_mode), st.st_size, fs_path=root)], [])
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(root, st)
    files: list[Source] = []
    dirs: list[tuple[str, int]] = []

    def walk(abs_dir: str, rel: str) -> None:
        try:
            entries = sorted(os.scandir(abs_dir), key=lambda e: e.name)
        except OSError as exc:
            raise StorageError(exc.errno or 5, f"cannot read the directory {abs_dir}: {exc.strerror or exc}") from None
        for e in entries:
            rel_path = f"{rel}/{e.name}" if rel else e.name
            why = check_relpath(rel_path)
            if why is not None:
                raise UnsupportedFileError(f"{e.path}: its name makes {why}; rename it, then commit again")
            est = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(est.st_mode):
                dirs.append((rel_path, stat.S_IMODE(est.st_mode)))
                walk(e.path, rel_path)
            elif stat.S_ISREG(est.st_mode):
                files.append(Source(rel_path, stat.S_IMODE(est.st_mode), est.st_size, fs_path=e.path))
            else:
                raise _refuse(e.path, est)

    walk(root, "")
    return Collected("dir", files, dirs)


def _from_mapping(mapping: Mapping[Any, Any]) -> Collected:
    files: list[Source] = []
    dirs: set[str] = set()
    for path, data in mapping.items():
        why = check_relpath(path)
        if why is not None:
            raise UnsupportedFileError(f"{str(path)[:200]!r} is {why}: use relative paths like 'part-0001.jsonl'")
        if isinstance(data, str):
            raise ArgumentTypeError(f"{path!r}: file contents must be bytes, got str (encode it, e.g. .encode())")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"{path!r}: file contents must be bytes, got {type(data).__name__}")
        try:
            view = memoryview(data).cast("B")
        except TypeError:  # a non-contiguous view (a strided NumPy slice): its bytes are not one range
            raise ArgumentTypeError(f"{path!r}: file contents must be contiguous bytes (copy a strided view with "
                                    "bytes(...) first)") from None
        files.append(Source(path, DEFAULT_FILE_MODE, len(view), data=view))
        parts = path.split("/")
        dirs.update("/".join(parts[:k]) for k in range(1, len(parts)))
    clash = sorted(d for d in dirs if d in {f.path for f in files})
    if clash:
        raise UnsupportedFileError(f"{clash[0]!r} is given both as a file and as a directory")
    files.sort(key=lambda f: f.path)
    return Collected("files", files, [(d, DEFAULT_DIR_MODE) for d in sorted(dirs)])

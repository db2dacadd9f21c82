"""Reading artifact versions back: ``checkout`` builds the whole directory beside its destination and renames it into
place once every chunk is verified and every file is durable; ``open`` streams one file, verifying each chunk."""

from __future__ import annotations

import io
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._crash import crashpoint
from .._process import pid_alive
from ..errors import LuopanError, OutputPathError, StorageFullError
from ..format.manifest import Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk
from ..repository.parallel import WORKERS, ordered_map
from ..store.base import Store

TMP_INFIX = ".tmp-"


def file_refs(owner: str, doc: dict[str, Any], entry: dict[str, Any]) -> list[ChunkRef]:
    packs = doc["packs"]
    return [ChunkRef(owner, entry["path"], n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)
            for n, r in enumerate(map(Row._make, entry["chunks"]))]


def _output_error(exc: OSError, path: str) -> OSError:
    if exc.errno in (28, 122):  # ENOSPC, EDQUOT
        return StorageFullError(exc.errno, f"no space left while writing {path}: the checkout was removed")
    return OutputPathError(exc.errno or 5, f"cannot write {path}: {exc.strerror or exc}; the checkout was removed")


def check_destination(dest: str | os.PathLike[str]) -> str:
    out = os.path.abspath(os.fspath(dest))
    if os.path.lexists(out):
        raise OutputPathError(17, f"{out} already exists: check out into a new path (a checkout never merges into "
                                  "or replaces existing files)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise OutputPathError(2, f"cannot check out to {out}: the directory {parent} does not exist; create it "
                                 f"first (mkdir -p {parent})")
    return out


def _remove_abandoned(parent: str, base: str) -> None:
    """Temporary checkout directories of ``base`` left by dead processes (kill -9 mid-checkout)."""
    prefix = f".{base}{TMP_INFIX}"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkout(store: Store, owner: str, doc: dict[str, Any], dest: str | os.PathLike[str],
             progress: Callable[[int], Any] | None = None) -> str:
    """Write every file and directory of a version under ``dest`` (which must not exist); returns its path."""
    out = check_destination(dest)
    parent, base = os.path.split(out)
    _remove_abandoned(parent, base)
    tmp = os.path.join(parent, f".{base}{TMP_INFIX}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(tmp, 0o700)
    except OSError as exc:
        raise _output_error(exc, out) from None
    try:
        _build(store, owner, doc, tmp, progress)
        crashpoint("artifact.checkout.built")
        if os.path.lexists(out):
            raise OutputPathError(17, f"{out} appeared while checking out: nothing was replaced")
        os.rename(tmp, out)
        _fsync(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, LuopanError):  # the destination's disk, not the store
            raise _output_error(exc, out) from None
        raise
    return out


def _build(store: Store, owner: str, doc: dict[str, Any], root: str, progress: Callable[[int], Any] | None) -> None:
    entries = doc["entries"]
    dirs = [e for e in entries if e["type"] == "dir"]
    files = [e for e in entries if e["type"] == "file"]
    for e in sorted(dirs, key=lambda e: e["path"].count("/")):
        os.mkdir(os.path.join(root, e["path"]), 0o700)
    sizes = PackSizes(store)
    sizes.prefetch({doc["packs"][Row._make(r).pack] for e in files for r in e["chunks"]})
    jobs = [(e, ref) for e in files for ref in file_refs(owner, doc, e)]

    def fetch(job: tuple[dict[str, Any], ChunkRef]) -> tuple[dict[str, Any], bytearray]:
        _e, ref = job
        buf = bytearray(ref.size)
        read_chunk(store, ref, memoryview(buf), sizes)  # verified before it reaches the file
        return job[0], buf

    handles: dict[str, Any] = {}
    try:
        for e in files:  # empty files too; each file is opened once, written in chunk order
            handles[e["path"]] = open(os.path.join(root, e["path"]), "xb", buffering=0)  # noqa: SIM115
        with ThreadPoolExecutor(WORKERS, "luopan-checkout") as pool:
            for e, buf in ordered_map(pool, fetch, jobs, window=4 * WORKERS):
                handles[e["path"]].write(buf)
                if progress is not None:
                    progress(len(buf))
        with ThreadPoolExecutor(WORKERS, "luopan-fsync") as pool:
            list(pool.map(lambda f: os.fsync(f.fileno()), handles.values()))
    finally:
        for f in handles.values():
            f.close()
    for e in files:
        os.chmod(os.path.join(root, e["path"]), e["mode"])
    for e in sorted(dirs, key=lambda e: -e["path"].count("/")):  # deepest first: a read-only one is set last
        path = os.path.join(root, e["path"])
        _fsync(path)
        os.chmod(path, e["mode"])
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    _fsync(root)


class VerifiedReader(io.RawIOBase):
    """A file of an artifact version, read chunk by chunk; each chunk is verified before any of its bytes is
    returned (IntegrityError otherwise)."""

    def __init__(self, store: Store, refs: list[ChunkRef], size: int, name: str) -> None:
        super().__init__()
        self._store = store
        self._refs: Iterator[ChunkRef] = iter(refs)
        self._sizes = PackSizes(store)
        self._buf = memoryview(b"")
        self.size = size
        self.name = name

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        while not self._buf:
            ref = next(self._refs, None)
            if ref is None:
                return 0
            chunk = bytearray(ref.size)
            read_chunk(self._store, ref, memoryview(chunk), self._sizes)
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

"""Reading artifact versions back: ``checkout`` builds the whole directory beside its destination and renames it into
place once every chunk is verified and every file is durable; ``open`` streams one file, verifying each chunk."""

from __future__ import annotations

import ctypes
import errno
import io
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from .._crash import crashpoint
from .._process import pid_alive
from .._files import write_error
from ..errors import ArgumentTypeError, LuopanError, OutputPathError
from ..format.manifest import Row
from ..repository.chunkio import ChunkRef, PackSizes, read_chunk
from ..repository.parallel import WORKERS, ordered_map
from ..store.base import Store
from .ownfiles import FILE_TMP_PREFIX

TMP_INFIX = ".tmp-"
CHECKOUT_MODE_MASK = 0o1777  # setuid and setgid are never restored: a repository from elsewhere plants no such binary
OPEN_FILES = 32  # files written and waiting for their fsync at once (a dataset of 100,000 files stays far from ulimit)
_HOST = socket.gethostname().replace("-", "_")
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def file_refs(owner: str, doc: dict[str, Any], entry: dict[str, Any]) -> list[ChunkRef]:
    packs = doc["packs"]
    return [ChunkRef(owner, entry["path"], n, r.hash, packs[r.pack], r.offset, r.length, r.size, r.codec)
            for n, r in enumerate(map(Row._make, entry["chunks"]))]


def _output_error(exc: OSError, path: str) -> BaseException:
    return write_error(exc, path, "the checkout was removed")


def check_destination(dest: object) -> str:
    if isinstance(dest, bytes):
        dest = os.fsdecode(dest)
    if not isinstance(dest, (str, os.PathLike)) or not os.fspath(dest):
        raise ArgumentTypeError(f"a checkout destination must be a path (str or os.PathLike), got {dest!r}")
    out = os.path.abspath(os.fspath(dest))
    if os.path.lexists(out):
        raise OutputPathError(17, f"{out} already exists and is not a folder: check out into a new path, or into "
                                  "a folder to update in place")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        try:
            os.makedirs(parent, exist_ok=True)  # like `git clone URL a/b/c`: the directories above are made
        except OSError as exc:
            raise OutputPathError(exc.errno or 5, f"cannot check out to {out}: cannot create {parent}: "
                                                  f"{exc.strerror or exc}") from None
    return out


def _remove_abandoned(parent: str, base: str) -> None:
    """Temporary checkout directories of ``base`` left by dead processes of this host (kill -9 mid-checkout)."""
    prefix = f".{base}{TMP_INFIX}{_HOST}-"
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


def _rename_noreplace(src: str, dst: str) -> None:
    """rename(2) that fails instead of replacing ``dst`` (renameat2 RENAME_NOREPLACE; a check, then rename, where the
    kernel or filesystem lacks it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def checkout(store: Store, owner: str, doc: dict[str, Any], dest: object,
             progress: Callable[[int], Any] | None = None, record: Callable[[str], None] | None = None) -> str:
    """Write every file and directory of a version under ``dest`` (which must not exist); returns its path.
    ``record(root)`` writes the checkout record into the new tree before it is renamed into place."""
    out = check_destination(dest)
    parent, base = os.path.split(out)
    _remove_abandoned(parent, base)
    tmp = os.path.join(parent, f".{base}{TMP_INFIX}{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(tmp, 0o700)
    except OSError as exc:
        raise _output_error(exc, out) from None
    try:
        _build(store, owner, doc, tmp, progress)
        if record is not None:
            record(tmp)
        _fsync(tmp)
        crashpoint("artifact.checkout.built")
        try:
            _rename_noreplace(tmp, out)
        except FileExistsError:
            raise OutputPathError(17, f"{out} appeared while checking out: nothing was replaced") from None
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
    for e in sorted(dirs, key=lambda e: e["path"].count("/")):
        os.mkdir(os.path.join(root, e["path"]), 0o700)
    write_files(store, owner, doc, [e for e in entries if e["type"] == "file"], root, progress, replace=False)
    for e in sorted(dirs, key=lambda e: -e["path"].count("/")):  # deepest first: a read-only one is set last
        path = os.path.join(root, e["path"])
        _fsync(path)
        os.chmod(path, e["mode"] & CHECKOUT_MODE_MASK)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)


def write_files(store: Store, owner: str, doc: dict[str, Any], files: list[dict[str, Any]], root: str,
                progress: Callable[[int], Any] | None, *, replace: bool) -> None:
    """Write the file ``entries`` of a version under ``root``, every chunk verified before it reaches a file, every
    file fsync'd and given its mode. ``replace=False``: each file is created at its path (a new tree).
    ``replace=True``: each is written to a temporary file beside its path (``FILE_TMP_PREFIX``), fsync'd, then
    renamed over the path, so the path holds its old bytes or the whole new file; the caller syncs the directories.
    On failure no temporary file is left."""
    sizes = PackSizes(store)
    sizes.prefetch({doc["packs"][Row._make(r).pack] for e in files for r in e["chunks"]})
    jobs = [(n, ref) for n, e in enumerate(files) for ref in file_refs(owner, doc, e)]
    left = [len(e["chunks"]) for e in files]  # chunks still to write, per file
    temps: dict[int, str] = {}  # file number -> its temporary path, until renamed (replace=True)

    def fetch(job: tuple[int, ChunkRef]) -> tuple[int, bytearray]:
        n, ref = job
        sizes.check(ref)  # before the buffer is sized by the row
        buf = bytearray(ref.size)
        read_chunk(store, ref, memoryview(buf), sizes)  # verified before it reaches the file
        return n, buf

    def finish(n: int, f: Any) -> None:
        try:
            os.fsync(f.fileno())
        finally:
            f.close()
        path = os.path.join(root, files[n]["path"])
        os.chmod(temps.get(n, path), files[n]["mode"] & CHECKOUT_MODE_MASK)
        if replace:
            os.replace(temps[n], path)
            del temps[n]
            crashpoint("artifact.checkout.file.renamed")

    slots = threading.BoundedSemaphore(OPEN_FILES)
    syncs: list[Future[None]] = []
    current: Any = None
    with ThreadPoolExecutor(WORKERS, "luopan-fsync") as fsyncs:
        def open_file(n: int) -> Any:
            slots.acquire()
            try:
                path = os.path.join(root, files[n]["path"])
                if replace:
                    path = temps[n] = os.path.join(os.path.dirname(path),
                                                   f"{FILE_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
                return open(path, "xb", buffering=0)  # noqa: SIM115
            except BaseException:
                slots.release()
                raise

        def close_file(n: int, f: Any) -> None:
            def run() -> None:
                try:
                    finish(n, f)
                finally:
                    slots.release()
            syncs.append(fsyncs.submit(run))

        try:
            try:
                for n in range(len(files)):  # empty files: no chunk will arrive for them
                    if not left[n]:
                        close_file(n, open_file(n))
                opened = -1
                with ThreadPoolExecutor(WORKERS, "luopan-checkout") as pool:
                    for n, buf in ordered_map(pool, fetch, jobs, window=4 * WORKERS):
                        if n != opened:  # chunks arrive in file order: each file is opened once, then closed
                            current, opened = open_file(n), n
                        current.write(buf)
                        if progress is not None:
                            progress(len(buf))
                        left[n] -= 1
                        if not left[n]:
                            close_file(n, current)
                            current = None
            finally:
                if current is not None:
                    current.close()
                    slots.release()
        except BaseException:
            for f in syncs:
                f.cancel()
            wait(syncs)
            for tmp in list(temps.values()):
                _unlink_quietly(tmp)
            raise
    try:
        for f in syncs:
            f.result()  # the first fsync/chmod/rename error, if any
    finally:
        for tmp in list(temps.values()):  # a file whose finish failed: its temporary file goes
            _unlink_quietly(tmp)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


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
            self._sizes.check(ref)  # before the buffer is sized by the row
            chunk = bytearray(ref.size)
            read_chunk(self._store, ref, memoryview(chunk), self._sizes)
            self._buf = memoryview(chunk)
        n = min(len(out), len(self._buf))
        out[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

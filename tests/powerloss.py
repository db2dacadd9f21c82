"""A power-loss simulator for the test suite (docs/format.md §10.6).

``Recorder(world)`` records every file operation the process makes under the directory ``world`` while it is
active — creates, writes (as the file's content after each call), truncates, fsyncs, renames, links, unlinks,
mkdirs and rmdirs, from ``os`` functions and ``open()`` alike, in any thread — and keeps a live mirror of the tree
it checks against the real one at the end, so an I/O path the recorder cannot see fails the test instead of
hiding. ``crash_states`` replays the record into every crash state the durability model allows:

* data written to a file and not yet fsynced may be lost, cut short, zero-filled or present page by page in any
  mix (each file independently);
* a directory entry (create, rename, link, unlink, mkdir, rmdir) is durable only once its parent directory was
  fsynced after it; unsynced entries may each be undone, in any combination (a rename within one directory is one
  entry change: both names move together).

At every crash point (after each recorded event) it builds the two extreme states (everything unsynced undone;
everything kept, as after a kill) and random ones between, materializes each into a fresh directory, and hands it
to the test's check with the acknowledgements (``Recorder.ack``) made before that point. Identical states are
checked once. ``STATES_PER_OPERATION`` (env ``LUOPAN_POWERLOSS_STATES``, 200 by default) bounds the states
checked per operation; ``make test-slow`` raises it. ``TOTAL`` counts the states checked in this process.

Fault injection (failing the ``n``-th ``write``, ``fsync``, ``rename`` or ``mkdir`` call under a directory with EIO,
ENOSPC or EDQUOT) is ``Faults`` in tests/faults.py, built on this module's ``_Hooks`` and ``_Paths``.
"""

from __future__ import annotations

import builtins
import errno as errnos
import hashlib
import io
import itertools
import os
import random
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PAGE = 4096
STATES_PER_OPERATION = int(os.environ.get("LUOPAN_POWERLOSS_STATES", "200"))
TOTAL = {"states": 0, "operations": 0}

_REAL = {name: getattr(os, name) for name in (
    "open", "close", "write", "writev", "pwrite", "pwritev", "ftruncate", "truncate", "fsync", "fdatasync",
    "replace", "rename", "link", "unlink", "remove", "mkdir", "rmdir", "symlink")}
_REAL_OPEN = builtins.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


class BlindSpot(AssertionError):
    """The recorder missed a file operation: its mirror of the tree disagrees with the disk."""


@dataclass
class Event:
    kind: str  # create mkdir data fsync rename link unlink rmdir ack
    path: str = ""
    dst: str = ""
    oid: int = -1
    data: bytes | None = None
    label: Any = None

    def __str__(self) -> str:
        if self.kind == "ack":
            return f"ack {self.label!r}"
        if self.kind == "data":
            return f"data #{self.oid} ({len(self.data or b'')} bytes)"
        return f"{self.kind} {self.path}{' -> ' + self.dst if self.dst else ''} #{self.oid}"


def _proc_fd(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


class _Hooks:
    """Patches the ``os`` functions and ``open`` that touch files, calling ``self.hook(name, real, args, kw)``
    for each; restored on ``stop``. Subclasses decide what a call does."""

    def start(self) -> None:
        self._saved: dict[tuple[Any, str], Any] = {}
        for name, real in _REAL.items():
            self._patch(os, name, self._wrap(name, real))
        self._patch(builtins, "open", self._wrap_open())
        self._patch(io, "open", builtins.open)

    def _patch(self, mod: Any, name: str, new: Any) -> None:
        self._saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, new)

    def stop(self) -> None:
        for (mod, name), old in self._saved.items():
            setattr(mod, name, old)
        self._saved = {}

    def _wrap(self, name: str, real: Callable) -> Callable:
        def call(*args: Any, **kw: Any) -> Any:
            return self.hook(name, real, args, kw)
        call.__name__ = name
        return call

    def _wrap_open(self) -> Callable:
        def open_(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
            return self.hook("builtins.open", _REAL_OPEN, (file, mode, *args), kw)
        return open_

    def hook(self, name: str, real: Callable, args: tuple, kw: dict) -> Any:
        return real(*args, **kw)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class _Paths:
    """Resolves call arguments to paths relative to ``world`` (None: outside it)."""

    def __init__(self, world: str) -> None:
        self.world = os.path.realpath(world)

    def rel(self, path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):
            return self.fd_rel(path)
        p = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(_proc_fd(dir_fd)), p)
        p = os.path.normpath(os.path.join(os.getcwd(), p))
        parent = os.path.realpath(os.path.dirname(p))  # the last component is not followed: it may be a link
        p = os.path.join(parent, os.path.basename(p)) if os.path.basename(p) else parent
        if p == self.world:
            return ""
        if p.startswith(self.world + os.sep):
            return p[len(self.world) + 1:]
        return None

    def fd_rel(self, fd: int) -> str | None:
        try:
            target = os.readlink(_proc_fd(fd))
        except OSError:
            return None
        if target.endswith(" (deleted)"):
            return None
        return self.rel(target)


def _write_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class Recorder(_Hooks, _Paths):
    """Records file operations under ``world`` (see the module docstring). Use as a context manager."""

    def __init__(self, world: str | os.PathLike[str]) -> None:
        _Paths.__init__(self, os.fspath(world))
        os.makedirs(self.world, exist_ok=True)
        self.events: list[Event] = []
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.names: dict[str, int] = {}  # live mirror: relative path -> object id ("" is the world)
        self.is_dir: dict[int, bool] = {}
        self.content: dict[int, bytes] = {}  # last content recorded of each file
        self._fds: dict[int, tuple[int, int]] = {}  # open fd -> (object id, st_ino)
        self._dirty: dict[int, set[int]] = {}  # object id -> fds open for writing
        self.base_names: dict[str, int] = {}
        self.base_content: dict[int, bytes] = {}
        self._scan()

    def _scan(self) -> None:
        self.names[""] = self._new(True)
        for top, dirs, files in os.walk(self.world):
            rel_top = os.path.relpath(top, self.world)
            rel_top = "" if rel_top == "." else rel_top
            for d in dirs:
                path = os.path.join(top, d)
                if os.path.islink(path):
                    raise NotImplementedError(f"the simulator does not model symbolic links: {path}")
                self.names[os.path.join(rel_top, d)] = self._new(True)
            for f in files:
                path = os.path.join(top, f)
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    raise NotImplementedError(f"the simulator models regular files and directories only: {path}")
                oid = self._new(False)
                self.names[os.path.join(rel_top, f)] = oid
                with _REAL_OPEN(path, "rb") as fh:
                    self.content[oid] = fh.read()
        self.base_names = dict(self.names)
        self.base_content = dict(self.content)
        self.base_dirs = {oid for oid, d in self.is_dir.items() if d}

    def _new(self, is_dir: bool) -> int:
        oid = next(self._ids)
        self.is_dir[oid] = is_dir
        if not is_dir:
            self.content[oid] = b""
        return oid

    # -- acknowledgements -------------------------------------------------------------------------------------------
    def ack(self, label: Any) -> None:
        """Mark that an operation returned to its caller: every crash state after this point must keep it."""
        with self._lock:
            self._capture()
            self.events.append(Event("ack", label=label))

    # -- the hook ---------------------------------------------------------------------------------------------------
    def hook(self, name: str, real: Callable, args: tuple, kw: dict) -> Any:
        with self._lock:
            if name == "builtins.open":
                return self._open_file(real, args, kw)
            handler = getattr(self, "_on_" + name, None)
            if handler is None:
                return real(*args, **kw)
            return handler(real, args, kw)

    def _capture(self) -> None:
        """Record the current content of every file open for writing that changed (writes through buffered file
        objects are invisible one by one: their bytes are seen here, at the next event)."""
        for oid, fds in list(self._dirty.items()):
            data = None
            for fd in list(fds):
                if not self._fd_valid(fd):
                    fds.discard(fd)
                    continue
                try:
                    with _REAL_OPEN(_proc_fd(fd), "rb") as fh:
                        data = fh.read()
                    break
                except OSError:
                    continue
            if data is None:
                data = self._read_by_name(oid)
            if data is not None and data != self.content.get(oid):
                self.content[oid] = data
                self.events.append(Event("data", oid=oid, data=data))
            if not fds:
                del self._dirty[oid]

    def _read_by_name(self, oid: int) -> bytes | None:
        for path, o in self.names.items():
            if o == oid:
                try:
                    with _REAL_OPEN(os.path.join(self.world, path), "rb") as fh:
                        return fh.read()
                except OSError:
                    return None
        return None

    def _fd_valid(self, fd: int) -> bool:
        entry = self._fds.get(fd)
        if entry is None:
            return False
        try:
            ok = os.fstat(fd).st_ino == entry[1]
        except OSError:
            ok = False
        if not ok:
            self._fds.pop(fd, None)
        return ok

    def _track(self, fd: int, oid: int, writing: bool) -> None:
        self._fds[fd] = (oid, os.fstat(fd).st_ino)
        if writing and not self.is_dir[oid]:
            self._dirty.setdefault(oid, set()).add(fd)

    def _oid_of_fd(self, fd: int) -> int | None:
        if self._fd_valid(fd):
            return self._fds[fd][0]
        rel = self.fd_rel(fd)
        if rel is None or rel not in self.names:
            return None
        oid = self.names[rel]
        self._track(fd, oid, _fd_writable(fd))
        return oid

    def _created(self, rel: str, is_dir: bool) -> int:
        oid = self._new(is_dir)
        self.names[rel] = oid
        self.events.append(Event("mkdir" if is_dir else "create", path=rel, oid=oid))
        return oid

    def _open_file(self, real: Callable, args: tuple, kw: dict) -> Any:
        file, mode = args[0], args[1] if len(args) > 1 else kw.get("mode", "r")
        rel = None if isinstance(file, int) else self.rel(file)
        if rel is None or not _write_mode(mode):
            return real(*args, **kw)
        self._capture()
        existed = rel in self.names
        f = real(*args, **kw)
        oid = self.names[rel] if existed else self._created(rel, False)
        self._track(f.fileno(), oid, True)
        self._capture()
        return f

    def _on_open(self, real: Callable, args: tuple, kw: dict) -> int:
        path, flags = args[0], args[1]
        rel = self.rel(path, kw.get("dir_fd"))
        if rel is None:
            return real(*args, **kw)
        self._capture()
        existed = rel in self.names
        fd = real(*args, **kw)
        if existed:
            oid = self.names[rel]
        elif flags & os.O_CREAT:
            oid = self._created(rel, False)
        else:
            _REAL["close"](fd)
            raise BlindSpot(f"{rel} was opened but the recorder never saw it created")
        self._track(fd, oid, bool(flags & (_WRITE_FLAGS | os.O_TRUNC)))
        self._capture()
        return fd

    def _data_call(self, real: Callable, args: tuple, kw: dict) -> Any:
        fd = args[0]
        oid = self._oid_of_fd(fd) if isinstance(fd, int) else None
        try:
            return real(*args, **kw)
        finally:
            if oid is not None:
                self._dirty.setdefault(oid, set()).add(fd)
                self._capture()

    _on_write = _on_writev = _on_pwrite = _on_pwritev = _on_ftruncate = _data_call

    def _on_truncate(self, real: Callable, args: tuple, kw: dict) -> Any:
        if isinstance(args[0], int):
            return self._data_call(real, args, kw)
        rel = self.rel(args[0])
        out = real(*args, **kw)
        if rel is not None and rel in self.names:
            oid = self.names[rel]
            with _REAL_OPEN(os.path.join(self.world, rel), "rb") as fh:
                data = fh.read()
            self.content[oid] = data
            self.events.append(Event("data", oid=oid, data=data))
        return out

    def _on_fsync(self, real: Callable, args: tuple, kw: dict) -> Any:
        fd = args[0] if isinstance(args[0], int) else args[0].fileno()
        oid = self._oid_of_fd(fd)
        self._capture()
        out = real(*args, **kw)
        if oid is not None:
            if not self.is_dir[oid]:  # what was synced is what the file holds now
                fds = self._dirty.get(oid)
                self._dirty.setdefault(oid, set()).add(fd)
                self._capture()
                if not fds:
                    self._dirty.get(oid, set()).discard(fd)
                    if not self._dirty.get(oid):
                        self._dirty.pop(oid, None)
            self.events.append(Event("fsync", oid=oid, path=self._name_of(oid)))
        return out

    _on_fdatasync = _on_fsync

    def _name_of(self, oid: int) -> str:
        return next((p for p, o in self.names.items() if o == oid), "?")

    def _on_close(self, real: Callable, args: tuple, kw: dict) -> Any:
        fd = args[0]
        self._capture()
        self._fds.pop(fd, None)
        for fds in self._dirty.values():
            fds.discard(fd)
        self._dirty = {o: f for o, f in self._dirty.items() if f}
        return real(*args, **kw)

    def _move(self, src: str, dst: str) -> None:
        """The mirror after ``src`` was renamed to ``dst`` (a directory moves with everything under it)."""
        moved = {p: o for p, o in self.names.items() if p == src or p.startswith(src + os.sep)}
        for p in moved:
            del self.names[p]
        for p in [p for p in self.names if p == dst or p.startswith(dst + os.sep)]:
            del self.names[p]
        for p, o in moved.items():
            self.names[dst + p[len(src):]] = o

    def _on_rename(self, real: Callable, args: tuple, kw: dict) -> Any:
        src = self.rel(args[0], kw.get("src_dir_fd"))
        dst = self.rel(args[1], kw.get("dst_dir_fd"))
        if src is None and dst is None:
            return real(*args, **kw)
        if src is None or dst is None:
            raise BlindSpot(f"a rename into or out of the simulated tree: {args[0]} -> {args[1]}")
        self._capture()
        out = real(*args, **kw)
        oid = self.names[src]
        self._move(src, dst)
        self.events.append(Event("rename", path=src, dst=dst, oid=oid))
        return out

    _on_replace = _on_rename

    def _on_link(self, real: Callable, args: tuple, kw: dict) -> Any:
        src = self.rel(args[0], kw.get("src_dir_fd"))
        dst = self.rel(args[1], kw.get("dst_dir_fd"))
        if src is None and dst is None:
            return real(*args, **kw)
        if src is None or dst is None:
            raise BlindSpot(f"a link into or out of the simulated tree: {args[0]} -> {args[1]}")
        self._capture()
        out = real(*args, **kw)
        self.names[dst] = self.names[src]
        self.events.append(Event("link", path=src, dst=dst, oid=self.names[src]))
        return out

    def _one_path(self, real: Callable, args: tuple, kw: dict, done: Callable[[str], None]) -> Any:
        """A call on one path (unlink, mkdir, rmdir): run it, then ``done(rel)`` updates the mirror and the record."""
        rel = self.rel(args[0], kw.get("dir_fd"))
        if rel is None:
            return real(*args, **kw)
        self._capture()
        out = real(*args, **kw)
        done(rel)
        return out

    def _removed(self, kind: str) -> Callable[[str], None]:
        return lambda rel: self.events.append(Event(kind, path=rel, oid=self.names.pop(rel)))

    def _on_unlink(self, real: Callable, args: tuple, kw: dict) -> Any:
        return self._one_path(real, args, kw, self._removed("unlink"))

    _on_remove = _on_unlink

    def _on_mkdir(self, real: Callable, args: tuple, kw: dict) -> Any:
        return self._one_path(real, args, kw, lambda rel: self._created(rel, True))

    def _on_rmdir(self, real: Callable, args: tuple, kw: dict) -> Any:
        return self._one_path(real, args, kw, self._removed("rmdir"))

    def _on_symlink(self, real: Callable, args: tuple, kw: dict) -> Any:
        if self.rel(args[1], kw.get("dir_fd")) is not None:
            raise BlindSpot(f"the simulator does not model symbolic links: {args[1]}")
        return real(*args, **kw)

    # -- stopping -------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        with self._lock:
            self._capture()
            super().stop()
            self._dirty.clear()
        self.check_mirror()

    def check_mirror(self) -> None:
        """The mirror must match the disk: same names, same kinds, same bytes. A mismatch means some write path
        escaped the recorder, and the crash states built from it would be wrong."""
        seen: dict[str, bool] = {"": True}
        for top, dirs, files in os.walk(self.world):
            rel_top = os.path.relpath(top, self.world)
            rel_top = "" if rel_top == "." else rel_top
            for d in dirs:
                seen[os.path.join(rel_top, d)] = True
            for f in files:
                seen[os.path.join(rel_top, f)] = False
        if set(seen) != set(self.names):
            raise BlindSpot(f"names the recorder missed: on disk only {sorted(set(seen) - set(self.names))[:5]}, "
                            f"in the mirror only {sorted(set(self.names) - set(seen))[:5]}")
        for path, is_dir in seen.items():
            oid = self.names[path]
            if self.is_dir[oid] != is_dir:
                raise BlindSpot(f"{path}: a {'directory' if is_dir else 'file'} on disk, not in the mirror")
            if not is_dir:
                with _REAL_OPEN(os.path.join(self.world, path), "rb") as fh:
                    if fh.read() != self.content[oid]:
                        raise BlindSpot(f"{path}: its bytes changed without the recorder seeing it")


def _fd_writable(fd: int) -> bool:
    import fcntl
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & _WRITE_FLAGS)

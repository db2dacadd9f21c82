"""Fault injection at single I/O calls for the test suite (issue 27).

``Faults(world, call, n, errno)`` is a context manager that fails the ``n``-th call of one kind made on a path
under the directory ``world``, in any thread, with ``OSError(errno)``:

* ``"write"``: ``os.write``, ``os.writev``, ``os.pwrite``, ``os.pwritev``, ``os.sendfile`` and the writes of file
  objects ``open()`` returns for writing (those are opened through ``_pyio``, whose raw file writes with
  ``os.write``, so a buffered file object's ``write``, ``flush`` and ``close`` meet the fault where the bytes really
  reach the file). A write failing with ENOSPC or EDQUOT first writes half its bytes, as a full disk does.
* ``"fsync"``: ``os.fsync`` and ``os.fdatasync`` (of files and directories).
* ``"rename"``: ``os.replace``, ``os.rename`` and ``os.link`` (luopan's no-replace commit: luopan.store.tempfiles).
* ``"mkdir"``: ``os.mkdir``, and through it ``os.makedirs`` and ``pathlib.Path.mkdir``.

A call that would fail anyway (``mkdir`` or ``link`` onto an existing name) is passed through and not counted: the
system answers those with EEXIST before it needs any space or I/O. Only the ``n``-th call fails (the fault then
clears), unless ``sticky=True``: then it and every later call of the kind fail, as a disk that stays full.

``Faults.count(world, op)`` runs ``op()`` and returns how many calls of each kind it made under ``world``, so a test
can fail every one of them in turn: ``for n in range(1, counts[call] + 1)``.

The hooks are tests/powerloss.py's (``_Hooks``: ``os`` functions and ``open`` patched for the duration; ``_Paths``:
arguments resolved to paths under ``world``).
"""

from __future__ import annotations

import _pyio
import errno as errnos
import os
import threading
from collections.abc import Callable
from typing import Any

from .powerloss import _REAL, _REAL_OPEN, _Hooks, _Paths, _write_mode

CALLS = ("write", "fsync", "rename", "mkdir")
ERRNOS = (errnos.EIO, errnos.ENOSPC, errnos.EDQUOT)
_FULL = (errnos.ENOSPC, errnos.EDQUOT)
_KIND = {
    "write": "write", "writev": "write", "pwrite": "write", "pwritev": "write", "sendfile": "write",
    "fsync": "fsync", "fdatasync": "fsync",
    "replace": "rename", "rename": "rename", "link": "rename",
    "mkdir": "mkdir",
}
_EXTRA = {name: getattr(os, name) for name in ("sendfile",)}  # not hooked by powerloss: patched here too


class Faults(_Hooks, _Paths):
    """Fail the ``n``-th ``call`` under ``world`` with ``errno`` (``n=None``: fail nothing, count; see the module
    docstring). After the block: ``fired`` (how many calls it failed), ``failed`` (the absolute path of the first),
    ``counts`` (calls of each kind seen)."""

    def __init__(self, world: str | os.PathLike[str], call: str | None = None, n: int | None = None,
                 errno: int = errnos.EIO, *, sticky: bool = False) -> None:
        if call is not None and call not in CALLS:
            raise ValueError(f"call is one of {CALLS}, not {call!r}")
        _Paths.__init__(self, os.fspath(world))
        self.call, self.n, self.errno, self.sticky = call, n, errno, sticky
        self.counts = dict.fromkeys(CALLS, 0)
        self.fired = 0
        self.failed: str | None = None
        self.trace: list[tuple[str, str, str]] = []  # (kind, os function, relative path) of every counted call
        self._lock = threading.RLock()

    @classmethod
    def count(cls, world: str | os.PathLike[str], op: Callable[[], Any]) -> dict[str, int]:
        """How many calls of each kind ``op()`` makes under ``world`` (it runs once, without faults)."""
        with cls(world) as f:
            op()
        return dict(f.counts)

    # -- hooking -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        super().start()
        for name, real in _EXTRA.items():
            self._patch(os, name, self._wrap(name, real))

    def hook(self, name: str, real: Callable, args: tuple, kw: dict) -> Any:
        if name == "builtins.open":
            return self._open_file(args, kw)
        kind = _KIND.get(name)
        if kind is None:
            return real(*args, **kw)
        rel = self._target(name, args, kw)
        if rel is None:
            return real(*args, **kw)
        if name in ("mkdir", "link") and self._exists(name, args, kw):
            return real(*args, **kw)  # EEXIST comes first: no fault to inject there
        with self._lock:
            self.counts[kind] += 1
            self.trace.append((kind, name, rel))
            fail = (kind == self.call and self.n is not None
                    and (self.counts[kind] == self.n or (self.sticky and self.counts[kind] > self.n)))
            if fail:
                self.fired += 1
                self.failed = self.failed or os.path.join(self.world, rel)
        if not fail:
            return real(*args, **kw)
        if kind == "write" and self.errno in _FULL:
            self._write_half(name, real, args, kw)
        raise self._error(name, args)

    def _open_file(self, args: tuple, kw: dict) -> Any:
        """``open()``: a file opened for writing under ``world`` is a ``_pyio`` one, whose raw writes call
        ``os.write`` (hooked); anything else is the real thing."""
        file = args[0]
        mode = args[1] if len(args) > 1 else kw.get("mode", "r")
        if _write_mode(mode):
            rel = self.fd_rel(file) if isinstance(file, int) else self.rel(file)
            if rel is not None:
                return _pyio.open(*args, **kw)
        return _REAL_OPEN(*args, **kw)

    def _target(self, name: str, args: tuple, kw: dict) -> str | None:
        """The path under ``world`` a call touches (None: outside it)."""
        if _KIND[name] in ("write", "fsync"):
            fd = args[0] if isinstance(args[0], int) else args[0].fileno()
            return self.fd_rel(fd)
        if name == "mkdir":
            return self.rel(args[0], kw.get("dir_fd"))
        src = self.rel(args[0], kw.get("src_dir_fd"))
        dst = self.rel(args[1], kw.get("dst_dir_fd"))
        return dst if dst is not None else src

    def _exists(self, name: str, args: tuple, kw: dict) -> bool:
        path, fd = (args[0], kw.get("dir_fd")) if name == "mkdir" else (args[1], kw.get("dst_dir_fd"))
        try:
            os.lstat(path, dir_fd=fd) if fd is not None else os.lstat(path)
        except OSError:
            return False
        return True

    def _write_half(self, name: str, real: Callable, args: tuple, kw: dict) -> None:
        """What a full disk does before it refuses: half the bytes reach the file."""
        if name == "sendfile":
            out_fd, in_fd, offset, count = args[:4]
            if count // 2:
                real(out_fd, in_fd, offset, count // 2)
            return
        if name in ("writev", "pwritev"):
            data = b"".join(bytes(b) for b in args[1])
            half = data[: len(data) // 2]
            if half:
                _REAL["pwrite"](args[0], half, args[2]) if name == "pwritev" else _REAL["write"](args[0], half)
            return
        data = memoryview(args[1]).cast("B")
        half = data[: len(data) // 2]
        if not half:
            return
        if name == "pwrite":
            _REAL["pwrite"](args[0], half, args[2])
        else:
            _REAL["write"](args[0], half)

    def _error(self, name: str, args: tuple) -> OSError:
        """The OSError the system would raise: path-based calls name their path(s), fd-based ones do not."""
        code = self.errno
        if _KIND[name] in ("write", "fsync"):
            return OSError(code, os.strerror(code))
        if name == "mkdir":
            return OSError(code, os.strerror(code), os.fsdecode(args[0]))
        return OSError(code, os.strerror(code), os.fsdecode(args[0]), None, os.fsdecode(args[1]))

    def __repr__(self) -> str:
        return f"Faults({self.call} #{self.n}, {errnos.errorcode.get(self.errno, self.errno)})"


"""A streamed write on a local filesystem (``Store.open_stream``; the others keep pieces: base.BufferedStream): a locked temp file in the key's top directory,
written with ``pwritev`` at the pieces' offsets from any thread, then fsynced, hard-linked to its key (never
replacing one) and the key's directory fsynced — the same steps and crash points as ``LocalStore.put_if_absent``, so
the data is durable before its name is."""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
from typing import Any

from .._crash import crashpoint
from .tempfiles import HOST, close_quietly, discard, link_new, try_lock, write_parts
from .walk import TMP_MARK

SYNC_FILE_RANGE_WRITE = 2

try:  # Linux: start writeback of a piece as soon as it is written, so the fsync at commit finds little left to do
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _sync_file_range = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without waiting: only a
    head start for the fsync that makes them durable (nothing counts as durable before it)."""
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # an error here changes nothing: fsync decides


class LocalStream:
    def __init__(self, store: Any, directory: str, kind: str) -> None:
        """A temp file in ``directory`` (a key prefix such as "packs"); ``kind`` names its crash points."""
        self.store, self.kind = store, kind
        self._lock = threading.Lock()
        self._done = False  # committed or discarded
        d = store._path(directory)
        name = f"new.{kind}{TMP_MARK}{HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        self.key = f"{directory}/{name}"  # for error messages: "no space left … while writing packs/new.pack.tmp-…"
        with store._mapping("write", self.key):
            store._ensure_dir(d)
            self.tmp = os.path.join(d, name)
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                try_lock(self.fd)  # held until the link: cleanup of gone writers' temporaries leaves it alone
            except BaseException:
                self.discard()
                raise

    def write_at(self, offset: int, parts: list[memoryview]) -> None:
        """Write ``parts`` (in order) at ``offset``; short writes are continued."""
        with self.store._mapping("write", self.key):
            start_writeback(self.fd, offset, write_parts(self.fd, parts, offset))

    def commit(self, key: str) -> bool:
        """fsync, then give the file the name ``key`` unless it is taken (False), then fsync its directory."""
        store, kind = self.store, self.kind
        path = store._path(key)
        with store._mapping("write", key):
            try:
                crashpoint(f"{kind}.written")
                os.fsync(self.fd)
                crashpoint(f"{kind}.fsynced")
                store._ensure_dir(os.path.dirname(path))
                linked = link_new(self.tmp, path)
                if linked:
                    crashpoint(f"{kind}.renamed")
            except BaseException:
                self.discard()
                raise
            self._done = True
            store._unlink_after(self.tmp, key)
            store._close_after(self.fd, key, "writing")
            if not linked:
                return False
            store._sync_placed(path, key)
            crashpoint(f"{kind}.dirsynced")
            return True

    def discard(self) -> None:
        """Drop the temp file (a failed or abandoned write)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        close_quietly(self.fd)
        discard(self.tmp)

"""The Store interface: the few primitives a repository needs from its storage.

Keys are relative, ``/``-separated paths (``packs/ab/<id>.pack``). Contracts every backend keeps:

* ``get`` / ``get_range`` / ``size`` of a missing key raise ``FileNotFoundError`` (a ``KeyNotFound``).
* ``get_range`` past the end returns the bytes that exist (possibly fewer than asked); callers check lengths.
* ``put`` is atomic: readers see the old value or the new one, never a mix. After it returns the value is durable.
* ``put_if_absent`` is atomic create-only: returns False, writing nothing, when the key exists. Write-once objects
  (packs, index files, manifests) use it, so they are never overwritten.
* ``delete`` of a missing key is a no-op.
* ``list(prefix)`` yields keys under ``prefix`` (a directory-like prefix ending in ``/`` or ``""``), in no
  particular order, never temporary files, and only keys that are valid (``valid_key``) and name something ``get``
  can read: a filesystem's FIFOs, sockets, devices, dangling links and symlink loops are passed over, and
  ``strays(prefix)`` names them with the reason, for callers to report. Symbolic links inside a repository are
  followed, to directories and files alike (docs/format.md §2): every walk of a repository sees the same keys.
* ``get``/``get_range``/``read_into``/``size`` of something that is not a regular object (a directory, a FIFO)
  raise ``KeyNotFound`` without opening it for reading in a way that could block.
* Running out of space raises ``luopan.errors.StorageFullError``; any other refusal or failure of the storage
  (permissions, a read-only filesystem, I/O errors, an unreachable server) raises ``luopan.errors.StorageError``
  naming the key. Both are ``OSError``s.
* An invalid key (``valid_key``) raises ``luopan.errors.InvalidNameError``.

Conveniences (``read_into``, ``get_limited``) are built on the primitives here; backends may override them.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ..errors import InvalidNameError, ObjectTooLargeError, StorageError

Buffer = Union[bytes, bytearray, memoryview]
Data = Union[Buffer, Sequence[Buffer]]


class KeyNotFound(FileNotFoundError):
    """A key is not in the store."""


@dataclass(frozen=True)
class Stray:
    """An entry a listing passed over: ``key`` (its relative path; ``/``-terminated for a directory), why, and
    whether it may hide objects the listing could not see (a dangling link, a directory that cannot be read) —
    then a walk of the repository is incomplete, and garbage collection must not trust it."""

    key: str
    reason: str
    unreadable: bool = False

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


def valid_key(key: object) -> bool:
    """A store key: a non-empty relative ``/``-separated path whose parts are non-empty and not ``.`` or ``..``, with
    no backslash or NUL. Keys luopan builds always are; an object store may hold others (``index//x.json``)."""
    if not isinstance(key, str) or not key or "\\" in key or "\0" in key:
        return False
    return all(part not in ("", ".", "..") for part in key.split("/"))


def check_key(key: str) -> str:
    if not valid_key(key):
        raise InvalidNameError(f"invalid store key {key!r}")
    return key


def too_large(key: str, size: int, limit: int, where: str) -> ObjectTooLargeError:
    return ObjectTooLargeError(
        f"{key} in {where} is {size} bytes, more than any valid file of its kind ({limit} bytes, docs/format.md "
        "§11): it is damaged or not luopan's; it was not read")


def as_parts(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(p).cast("B") for p in data]


def retract(store: Store, key: str, data: bytes) -> None:
    """Delete the manifest ``key`` if it holds ``data`` (best effort). After its ``put_if_absent`` raised, the name
    may be visible though not durable (the directory sync failed): an operation that reports failure must not leave
    it behind, or a retry would commit a second version, or trust one a power loss can take back. Never for
    content-addressed keys (packs, index files): another writer may be using the same one."""
    try:
        if store.get(key) == data:
            store.delete(key)
    except OSError:
        pass


class Store(abc.ABC):
    """Abstract key/value store. See the module docstring for the contracts."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None: ...

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: Data) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    # -- conveniences -------------------------------------------------------------------------------------------
    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes at ``offset`` into ``out``; returns the number of bytes read (short at EOF)."""
        data = self.get_range(key, offset, len(out))
        if len(data) > len(out):  # a server that ignored the range: never pass on bytes from elsewhere
            raise StorageError(f"{key}: the store returned {len(data)} bytes for a read of {len(out)} at offset "
                               f"{offset}; it does not honour ranged reads (check the server or proxy)")
        out[: len(data)] = data
        return len(data)

    def get_limited(self, key: str, limit: int) -> bytes:
        """The whole object, refusing (``ObjectTooLargeError``, before reading it) one larger than ``limit`` bytes:
        for files luopan reads whole and parses (manifests, index files, refs, records), so a huge file cannot
        cost memory in proportion to its size."""
        size = self.size(key)
        if size > limit:
            raise too_large(key, size, limit, self.describe())
        data = self.get(key)
        if len(data) > limit:  # replaced by a larger one in between
            raise too_large(key, len(data), limit, self.describe())
        return data

    def list_flat(self, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (which ends in ``/``), not below it: for directories luopan keeps flat
        (``locks/``), so a link or a deep tree there costs nothing. Backends may override it for speed."""
        return [k for k in self.list(prefix) if "/" not in k[len(prefix):]]

    def list_with_strays(self, prefix: str = "") -> tuple[list[str], list[Stray]]:
        """``list(prefix)`` and ``strays(prefix)`` together; backends that walk a tree do both in one walk."""
        return list(self.list(prefix)), self.strays(prefix)

    def strays(self, prefix: str = "") -> list[Stray]:
        """Entries under ``prefix`` that ``list`` passes over because they cannot be objects (special files,
        dangling links, symlink loops, invalid keys), each with the reason. Backends that hold only objects: none."""
        return []

    def cleanup_temporaries(self) -> int:
        """Remove temporaries left by dead writers; returns how many. Backends without temporaries do nothing."""
        return 0

    def signature(self, key: str) -> tuple[int, ...] | None:
        """Something that changes whenever the object is replaced, truncated or rewritten through the filesystem
        (size first), or None when the backend cannot say (then callers do not cache checks of it)."""
        return None

    def modified(self, key: str) -> float | None:
        """When the object was last written (unix time), or None when the backend cannot say. Garbage collection
        never deletes an unreferenced pack younger than its grace period (a save in progress may be writing it)."""
        return None

    def free_bytes(self) -> int | None:
        """Bytes free for new data where this store writes, or None when unknown or unbounded (object stores)."""
        return None

    def open_stream(self, directory: str) -> Any:
        """A streamed write (luopan.store.streams): pieces written at offsets as they come, committed under a key of
        ``directory`` chosen at the end (``put_if_absent`` semantics). This default keeps the pieces and puts them
        whole at commit."""
        return BufferedStream(self)

    def lock_path(self) -> str | None:
        """A file whose ``flock`` excludes this store's writers (a repository on a local filesystem; §9.2), or None:
        lock records alone."""
        return None

    def describe(self) -> str:
        return type(self).__name__


class BufferedStream:
    """Pieces kept (zero-copy) until ``commit`` puts them as one object."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pieces: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    def write_at(self, offset: int, parts: list[memoryview]) -> None:
        with self._lock:
            self._pieces[offset] = list(parts)

    def commit(self, key: str) -> bool:
        """Store the file as ``key`` unless that key exists (False); durable when this returns True."""
        with self._lock:
            parts = [p for off in sorted(self._pieces) for p in self._pieces[off]]
            self._pieces.clear()
        return self.store.put_if_absent(key, parts)

    def discard(self) -> None:
        with self._lock:
            self._pieces.clear()

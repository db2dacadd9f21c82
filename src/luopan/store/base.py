"""The Store interface: the few primitives a repository needs from its storage.

Keys are relative, ``/``-separated paths (``packs/ab/<id>.pack``). Contracts every backend keeps:

* ``get`` / ``get_range`` / ``size`` of a missing key raise ``FileNotFoundError`` (a ``KeyNotFound``).
* ``get_range`` past the end returns the bytes that exist (possibly fewer than asked); callers check lengths.
* ``put`` is atomic: readers see the old value or the new one, never a mix. After it returns the value is durable.
* ``put_if_absent`` is atomic create-only: returns False, writing nothing, when the key exists. Write-once objects
  (packs, index files, manifests) use it, so they are never overwritten.
* ``delete`` of a missing key is a no-op.
* ``list(prefix)`` yields keys under ``prefix`` (a directory-like prefix ending in ``/`` or ``""``), in no
  particular order, never temporary files.
* Running out of space raises ``luopan.errors.StorageFullError``; the failed key is left absent or unchanged.

Conveniences (``read_into``) are built on the primitives here; backends may override them for speed.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import Union

Buffer = Union[bytes, bytearray, memoryview]
Data = Union[Buffer, Sequence[Buffer]]


class KeyNotFound(FileNotFoundError):
    """A key is not in the store."""


def as_parts(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(p).cast("B") for p in data]


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
        out[: len(data)] = data
        return len(data)

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

    def describe(self) -> str:
        return type(self).__name__

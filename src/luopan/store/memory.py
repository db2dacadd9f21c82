"""In-memory store, for tests and ephemeral repositories. Thread-safe; values are immutable bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from .base import Data, KeyNotFound, Store, as_parts


class MemoryStore(Store):
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._times: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        try:
            return self._data[key]
        except KeyError:
            raise KeyNotFound(key) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.get(key)[offset : offset + length]

    def put(self, key: str, data: Data) -> None:
        value = b"".join(as_parts(data))
        with self._lock:
            self._data[key] = value
            self._times[key] = time.time()

    def put_if_absent(self, key: str, data: Data) -> bool:
        value = b"".join(as_parts(data))
        with self._lock:
            if key in self._data:
                return False
            self._data[key] = value
            self._times[key] = time.time()
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)
            self._times.pop(key, None)

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            keys = [k for k in self._data if k.startswith(prefix)]
        return iter(keys)

    def exists(self, key: str) -> bool:
        return key in self._data

    def size(self, key: str) -> int:
        return len(self.get(key))

    def modified(self, key: str) -> float | None:
        try:
            return self._times[key]
        except KeyError:
            raise KeyNotFound(key) from None

    def describe(self) -> str:
        return "memory://"

"""The op log of an index (docs/format.md §17.5): ``log_add``/``log_remove`` records appended to the core's log
(luopan.repository.wal) at ``indexes/<name>/log/`` of a local repository, each tagged with the live version it was
logged against, and replayed in order on that version by ``load()``.

Record payload (little-endian; no pickle)::

    b"LPIXOP1\\0" | u32 header length | header: canonical JSON
        {"base": version, "count": n, "dim": d, "op": "add" | "remove"}
    | ids: n x int64 | vectors (add only): n x d x float32
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    ArgumentTypeError,
    CorruptJournalError,
    IntegrityError,
    LuopanError,
    UsageError,
)
from ..format.canonical import canonical
from ..repository.wal import Log
from ..store.local import LocalStore

MAGIC = b"LPIXOP1\0"
_HEAD = struct.Struct("<8sI")
MAX_HEADER = 4096
OPS = ("add", "remove")


@dataclass
class Op:
    op: str
    base: int
    ids: np.ndarray
    vectors: np.ndarray | None


def check_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """A 1-D int64 array of ``ids`` (any integer array-like); ArgumentTypeError otherwise."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ArgumentTypeError(f"{what} must be a 1-D array of integers (e.g. numpy int64), got "
                                f"{arr.dtype} with shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 1 << 63:
        raise ArgumentTypeError(f"{what} must fit in int64")
    return np.ascontiguousarray(arr, dtype="<i8")


def check_vectors(vectors: Any, dim: int) -> np.ndarray:
    """An (n, dim) float32 array; ArgumentTypeError for another kind or shape."""
    arr = np.asarray(vectors)
    if arr.dtype.kind != "f" or arr.ndim != 2 or arr.shape[1] != dim:
        raise ArgumentTypeError(f"vectors must be a 2-D float array of shape (n, {dim}) (the index's dimension), got "
                                f"{arr.dtype} with shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<f4")


def encode(op: str, base: int, ids: np.ndarray, vectors: np.ndarray | None) -> bytes:
    if op not in OPS:
        raise UsageError(f"unknown op {op!r}")
    dim = 0 if vectors is None else int(vectors.shape[1])
    header = canonical({"base": base, "count": len(ids), "dim": dim, "op": op})
    parts = [_HEAD.pack(MAGIC, len(header)), header, ids.tobytes()]
    if vectors is not None:
        parts.append(vectors.tobytes())
    return b"".join(parts)


def decode(payload: bytes, where: str) -> Op:
    """One record, checked: IntegrityError naming ``where`` (the log and seq) when it is not one this code wrote."""

    def bad(msg: str) -> IntegrityError:
        return IntegrityError(f"index op log {where}: {msg}")

    if len(payload) < _HEAD.size:
        raise bad("record too short")
    magic, hlen = _HEAD.unpack_from(payload)
    if magic != MAGIC or hlen > MAX_HEADER or _HEAD.size + hlen > len(payload):
        raise bad("not an index op record")
    try:
        head = json.loads(payload[_HEAD.size:_HEAD.size + hlen])
    except (ValueError, UnicodeDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(head, dict) or set(head) != {"base", "count", "dim", "op"} or head["op"] not in OPS or not all(
            isinstance(head[k], int) and not isinstance(head[k], bool) and 0 <= head[k] < 1 << 48
            for k in ("base", "count", "dim")):
        raise bad("its header is invalid")
    n, dim, start = head["count"], head["dim"], _HEAD.size + hlen
    want = n * 8 + (n * dim * 4 if head["op"] == "add" else 0)
    if len(payload) - start != want or (head["op"] == "add") != (dim > 0) and n > 0:
        raise bad(f"it holds {len(payload) - start} bytes of data, its header says {want}")
    ids = np.frombuffer(payload, dtype="<i8", count=n, offset=start).astype(np.int64)
    vectors = None
    if head["op"] == "add":
        vectors = np.frombuffer(payload, dtype="<f4", count=n * dim, offset=start + n * 8).reshape(n, dim)
        vectors = vectors.astype(np.float32)
    return Op(head["op"], head["base"], ids, vectors)


class OpLog:
    """The op log of index ``name`` in a repository: the core's Log at ``indexes/<name>/log/`` of a local store,
    opened for writing on the first append (one writer at a time) and read-only for replay."""

    def __init__(self, repo: Any, name: str, fsync: str) -> None:
        self.repo, self.name, self.fsync = repo, name, fsync
        self._log: Any = None

    def directory(self) -> str | None:
        store = self.repo.store
        store = getattr(store, "local", store)
        root = getattr(store, "root", None)
        if not isinstance(store, LocalStore) or root is None:
            return None
        return os.path.join(root, "indexes", *self.name.split("/"), "log")

    def append(self, payload: bytes, floor: int = 0) -> int:
        """Append a record; ``floor`` is the live version's ``log_start``: a log that ends before it (its directory
        lost, or its unsynced tail cut by a crash) would hand out seqs that load() skips, so that is refused."""
        if self._log is None:
            path = self.directory()
            if path is None:
                raise UsageError(f"index op logs need a local repository; {self.repo.where} is not one: snapshot "
                                 "the index instead of logging ops")
            self._log = Log(path, fsync=self.fsync, start_seq=floor)
        if self._log.next_seq < floor:
            raise CorruptJournalError(f"the op log of index {self.name!r} ({self._log.directory}) ends at record "
                                      f"{self._log.next_seq}, before the live version's start ({floor}): records "
                                      "were lost; snapshot the index to start a clean log")
        return int(self._log.append(payload))

    def _reader(self) -> Any:
        if self._log is not None:
            return self._log
        path = self.directory()
        if path is None or not os.path.isdir(path):
            return None
        return Log(path, read_only=True)

    def next_seq(self) -> int:
        log = self._reader()
        if log is None:
            return 0
        try:
            return int(log.next_seq)
        finally:
            if log is not self._log:
                log.close()

    def ops(self, version: int, start: int) -> list[Op]:
        """The records logged against ``version`` from seq ``start`` on, in order."""
        log = self._reader()
        if log is None:
            return []
        try:
            first = max(start, log.first_seq) if log.next_seq > start else log.next_seq
            ops = [decode(payload, f"{log.directory} record {seq}") for seq, payload in log.items(first)]
        finally:
            if log is not self._log:
                log.close()
        return [op for op in ops if op.base == version]

    def drop_before(self, seq: int) -> None:
        if self._log is not None:
            self._log.drop_before(seq)

    def close(self) -> None:
        if self._log is not None:
            log, self._log = self._log, None
            log.close()


def apply(fc: Any, index: Any, op: Op) -> None:
    """Replay one op on a loaded index: ``remove_ids``, ``add_with_ids`` (IVF, IDMap) or ``add``."""
    try:
        if op.op == "remove":
            index.remove_ids(op.ids)
        elif fc.accepts_ids(index):
            index.add_with_ids(op.vectors, op.ids)
        else:
            index.add(op.vectors)
    except RuntimeError as exc:
        raise LuopanError(f"replaying a logged {op.op} on the index failed: {str(exc).splitlines()[0]}; "
                          "load(version=N) loads the snapshot without its op log, and a snapshot or a rollback to "
                          "another version starts a clean log") from None

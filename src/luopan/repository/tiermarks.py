"""The local records of a tiered repository (docs/format.md §10.2, "Local files"), for manifests of every kind.

``tier/<state>/<kind.marker><series>/<number:08d>.json``, sealed JSON with ``run`` (the series) and ``step`` (the
number), where state is ``pending`` (committed locally, not yet confirmed on the remote; ``replicating_pid`` and
``started`` once a copy starts), ``replicated`` (confirmed: ``manifest_checksum`` names the manifest copied) or
``cold`` (moved to the cold tier). Checkpoints' marker is "" (``tier/pending/<run>/…``), artifacts'
``_artifacts/``. They live on the local tier only and are never copied.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any, NamedTuple

from .._process import pid_alive
from ..errors import IntegrityError, LuopanError
from ..format import BASE_FORMAT_VERSION
from ..format.canonical import SealError, seal, sealed_checksum, unseal
from ..format.limits import MAX_MANIFEST_BYTES, MAX_SMALL_BYTES
from ..format.names import step_from_manifest_key, tier_marker_key
from ..store.base import KeyNotFound, Store
from ..store.tiered import Markers
from .kinds import Kind

STATES = ("pending", "replicated", "cold")


class Item(NamedTuple):
    """One manifest: ``number`` of ``series`` of ``kind`` (a checkpoint: run and step; an artifact version)."""

    kind: Kind
    series: str
    number: int

    def __repr__(self) -> str:
        return f"Item({self.kind.name}, {self.series!r}, {self.number})"

    def label(self) -> str:
        return self.kind.label(self.series, self.number)

    @property
    def key(self) -> str:
        return self.kind.manifest_key(self.series, self.number)

    def marker(self, state: str) -> str:
        return tier_marker_key(state, self.kind.marker, self.series, self.number)

    def markers(self) -> Markers:
        return Markers(*(self.marker(s) for s in STATES))


def manifest_item(kinds: tuple[Kind, ...], key: str) -> Item | None:
    """The manifest a store key names (exactly ``kind.manifest_key(series, number)`` of a valid series), or None."""
    number = step_from_manifest_key(key)
    if number is None:
        return None
    for kind in kinds:
        if not key.startswith(kind.root):
            continue
        head, _, tail = kind.manifest_key("\0", number).partition("\0")
        if len(key) <= len(head) + len(tail) or not (key.startswith(head) and key.endswith(tail)):
            continue
        series = key[len(head):len(key) - len(tail)]
        try:
            kind.check_series(series)
        except LuopanError:
            continue
        if kind.manifest_key(series, number) == key:
            return Item(kind, series, number)
    return None


def now_text() -> str:
    return datetime.now(timezone.utc).isoformat()


class Records:
    """Reads and writes the records of one local tier."""

    def __init__(self, local: Store) -> None:
        self.local = local

    def _doc(self, item: Item, **fields: Any) -> bytes:
        return seal({"format_version": BASE_FORMAT_VERSION, "run": item.series, "step": item.number, **fields})

    def read(self, item: Item, state: str) -> dict[str, Any] | None:
        """The record, or None when it is missing or damaged (then it counts as absent)."""
        try:
            return unseal(self.local.get_limited(item.marker(state), MAX_SMALL_BYTES))
        except (KeyNotFound, SealError, IntegrityError):
            return None

    def numbers(self, state: str, kind: Kind, series: str) -> set[int]:
        """The numbers of ``series`` with a record in ``state``."""
        prefix = tier_marker_key(state, kind.marker, series, 0).rsplit("/", 1)[0] + "/"
        out = set()
        for key in self.local.list(prefix):
            stem = key[len(prefix):].removesuffix(".json")  # "b/00000001" under "a/" is artifact a/b's: skipped
            if key.endswith(".json") and stem.isascii() and stem.isdigit() and f"{int(stem):08d}" == stem:
                out.add(int(stem))
        return out

    def confirmed(self, item: Item) -> bool:
        """Whether the remote holds exactly the local manifest (its replicated record names it)."""
        record = self.read(item, "replicated")
        if record is None:
            return False
        try:
            local = self.local.get_limited(item.key, MAX_MANIFEST_BYTES)
        except KeyNotFound:
            return True  # evicted: only the remote has it, as confirmed
        return record.get("manifest_checksum") == sealed_checksum(local)

    def pending_elsewhere(self, item: Item) -> bool:
        """Another live process on this host is copying it (its pending record says so)."""
        record = self.read(item, "pending")
        pid = record.get("replicating_pid") if record is not None else None
        return pid != os.getpid() and pid_alive(pid)

    def pending(self, item: Item) -> None:
        """Committed (or replaced) locally: unconfirmed until copied again."""
        self.local.delete(item.marker("replicated"))
        self.local.put(item.marker("pending"), self._doc(item, created=now_text()))

    def started(self, item: Item) -> None:
        """A copy by this process starts (other processes then show it as replicating)."""
        doc = self.read(item, "pending") or {"created": now_text()}
        doc.pop("checksum", None)
        for name in ("format_version", "run", "step"):
            doc.pop(name, None)
        doc.update(replicating_pid=os.getpid(), started=now_text())
        self.local.put(item.marker("pending"), self._doc(item, **doc))

    def replicated(self, item: Item, data: bytes, remote: str) -> None:
        """The manifest ``data`` was written to and read back from ``remote``."""
        self.local.put(item.marker("replicated"), self._doc(item, replicated=now_text(), remote=remote,
                                                           manifest_checksum=sealed_checksum(data)))
        self.local.delete(item.marker("pending"))

    def moved_cold(self, item: Item, cold: str) -> None:
        self.local.put(item.marker("cold"), self._doc(item, moved=now_text(), cold=cold))

    def forget(self, item: Item, *states: str) -> None:
        for state in states:
            self.local.delete(item.marker(state))

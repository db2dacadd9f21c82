"""What the checkpoint kind reports: a committed checkpoint, a save in flight, a verification."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..errors import IntegrityError
from ..format.manifest import Manifest
from ..store.base import Stray


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``Repo.checkpoints`` and ``Repo.save`` report about one committed checkpoint."""

    run: str
    step: int
    created: str
    metrics: dict[str, Any]
    logical_bytes: int  # bytes of the state (tied tensors counted once)
    new_bytes: int  # raw bytes of chunks this save added to the repository
    stored_bytes: int  # bytes of pack files this save wrote (after compression, with framing)
    chunks: int
    new_chunks: int
    fingerprint: str
    manifest: str = field(repr=False)
    save_seconds: float | None = None  # wall seconds from the save call to its commit (None: not recorded)
    stall_seconds: float | None = None  # seconds the caller was blocked (save_async: the host copy)

    @property
    def dedup_ratio(self) -> float:
        """logical bytes / bytes this save stored (inf when it stored nothing new)."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @classmethod
    def from_manifest(cls, m: Manifest, key: str) -> CheckpointInfo:
        s = m.stats
        return cls(m.run, m.step, m.created, m.metrics, s["logical_bytes"], s["new_bytes"], s["stored_bytes"],
                   s["chunks"], s["new_chunks"], m.doc["fingerprint"], key, _seconds(s.get("save_us")),
                   _seconds(s.get("stall_us")))


def _seconds(value: object) -> float | None:
    """A timing of the manifest's stats, stored in integer microseconds (optional: older manifests lack them)."""
    return value / 1e6 if isinstance(value, int) and not isinstance(value, bool) else None


class SaveHandle:
    """A save_async in flight. ``wait()`` returns its CheckpointInfo or raises its error."""

    def __init__(self, future: Future[CheckpointInfo], run: str, step: int) -> None:
        self._future = future
        self._observed = False
        self.run = run
        self.step = step

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the checkpoint is committed (or the save failed: then raise its error)."""
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():  # a timeout does not count as having seen the outcome
                self._observed = True

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<luopan.SaveHandle run={self.run!r} step={self.step} {state}>"


@dataclass(frozen=True)
class VerifyReport:
    checkpoints: int
    chunks: int
    bytes: int
    problems: list[IntegrityError]
    strays: list[Stray] = field(default_factory=list)  # entries that are not luopan's, skipped (not damage)

    @property
    def ok(self) -> bool:
        return not self.problems

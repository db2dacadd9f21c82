"""Double-buffered staging for save_async: a save copies the state into one of two host buffer sets while the
previous save may still be writing from the other; one background worker commits them one at a time, in call order.

At most two saves are in flight: one writing, one copied and queued behind it. A third save_async waits for the
first to finish, since that frees the only set it may copy into: a copy never overwrites a set a save still reads.
The second set is allocated only once a save_async finds the first still in use, so a loop whose saves finish between
calls holds one copy of the state; a loop whose saves overlap holds up to two (pinned, for device tensors).
``save_async(..., overlap=False)`` waits for the saves in flight first and frees the other set.

What a new save decides while its caller waits must not depend on a save still in flight (Repo._prepare): a
trust_versions reuse decision waits for the saves in flight when it could skip a tensor, because it needs the version
records, chunk rows and chunk index of a *committed* previous save; a save of a step in flight waits for it before the
exists check; ``inputs`` wait (they may name a checkpoint in flight). Everything else the background commit reads
(previous chunk rows, row-delta tracks) it reads on the worker, after the saves before it have committed.

Errors: a failed save's error nobody observed (``handle.wait()``) is raised by the next save/save_async/drain/close;
where several failed unseen, the first is raised and names the others.
"""

from __future__ import annotations

import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .buffers import HostBuffers
from .info import CheckpointInfo, SaveHandle
from .request import same_version

SETS = 2  # buffer sets: one save writing + one save copying


@dataclass
class Slot:
    """A save_async in flight and the buffer set it reads."""

    handle: SaveHandle
    buffers: int  # index into Staging.sets
    versions: dict[str, tuple[Any, ...]]  # its tensor version records: the run's previous save once it commits
    nbytes: int  # logical bytes it may still write (the space preflight of the next save counts them)


class Staging:
    """Buffer sets and the save_asyncs in flight of one repository (used by the caller's thread only)."""

    def __init__(self, sets: int = SETS) -> None:
        self.sets = [HostBuffers() for _ in range(sets)]
        self.inflight: deque[Slot] = deque()
        self.last = 0  # the set of the newest save: reused first, so the other is allocated only when needed

    def busy(self) -> bool:
        return bool(self.inflight)

    def newest(self) -> SaveHandle | None:
        return self.inflight[-1].handle if self.inflight else None

    def holds(self, run: str, step: int) -> bool:
        return any(s.handle.run == run and s.handle.step == step for s in self.inflight)

    def prior(self, run: str) -> Future[CheckpointInfo] | None:
        """The newest save of ``run`` in flight (the one a new save of the run is made after)."""
        for slot in reversed(self.inflight):
            if slot.handle.run == run:
                return slot.handle._future
        return None

    def pending_bytes(self) -> int:
        return sum(s.nbytes for s in self.inflight)

    def could_reuse(self, run: str, versions: dict[int, tuple[str, tuple[Any, ...]]],
                    committed: dict[str, tuple[Any, ...]]) -> bool:
        """Whether a trust_versions save could skip a tensor: one of its version records matches the newest save of
        ``run`` (in flight, else committed). If not, no tensor is skippable whichever way the saves in flight end."""
        basis = committed
        for slot in reversed(self.inflight):
            if slot.handle.run == run:
                basis = slot.versions
                break
        return any(path in basis and same_version(basis[path], rec) for path, rec in versions.values())

    def acquire(self, overlap: bool) -> int:
        """The buffer set the next save copies into. Raises the unseen error of a save that has finished; waits
        while every set is read by a save in flight (a third save waits for the first), or, without ``overlap``,
        for every save in flight (and frees the other sets)."""
        self.reap()
        if not overlap:
            self.drain()
            for i, buffers in enumerate(self.sets):
                if i != self.last:
                    buffers.clear()
            return self.last
        while len(self.inflight) >= len(self.sets):
            self.inflight[0].handle._future.exception()  # wait for the oldest
            self.reap()
        reading = {s.buffers for s in self.inflight}
        if self.last not in reading:
            return self.last
        return next(i for i in range(len(self.sets)) if i not in reading)

    def submitted(self, handle: SaveHandle, buffers: int, versions: dict[str, tuple[Any, ...]], nbytes: int) -> None:
        self.inflight.append(Slot(handle, buffers, versions, nbytes))
        self.last = buffers

    def reap(self) -> None:
        """Forget the saves that have finished (in order: one worker); raise an error no caller has observed."""
        done = []
        while self.inflight and self.inflight[0].handle.done():
            done.append(self.inflight.popleft())
        _raise_unseen(done)

    def drain(self) -> None:
        """Wait for every save in flight; raise an error no caller has observed."""
        for slot in list(self.inflight):
            slot.handle._future.exception()  # wait first: if this is interrupted the saves stay in flight
        done = list(self.inflight)
        self.inflight.clear()
        _raise_unseen(done)

    def release(self) -> None:
        for buffers in self.sets:
            buffers.clear()


def _raise_unseen(slots: list[Slot]) -> None:
    errors = []
    for slot in slots:
        handle = slot.handle
        exc = handle._future.exception()
        if exc is not None and not handle._observed:
            handle._observed = True
            errors.append((handle, exc))
    if not errors:
        return
    (handle, exc), rest = errors[0], errors[1:]
    notes = [f"(raised by the background save_async of run {handle.run!r} step {handle.step})"]
    notes += [f"(the background save_async of run {h.run!r} step {h.step} failed too: {e!r})" for h, e in rest]
    if hasattr(exc, "add_note"):
        for note in notes:
            exc.add_note(note)
    else:  # Python 3.10: no notes; the others are still reported, never dropped
        for note in notes[1:]:
            warnings.warn(note, stacklevel=3)
    raise exc

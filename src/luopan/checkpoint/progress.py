"""Progress and logs of checkpoint saves.

Every committed save logs one INFO record to the ``luopan`` logger (``logging.getLogger("luopan")``: silent unless the
program configures logging) with its step, bytes written, duration and stall; the record's ``luopan_save`` attribute
holds the figures as a dict (``SaveReport.as_dict``). A save that takes longer than ``PROGRESS_AFTER`` seconds also
reports on stderr, unless disabled (``progress=False`` on ``luopan.open``, ``repo.save``/``save_async`` or
``CheckpointManager``): a ``rich`` progress bar while a synchronous save runs when stderr is a terminal, and one
summary line once it is committed (left out when the ``luopan`` logger already emits INFO records somewhere, which
carry the same line). A background save (``save_async``) never draws a bar over the training loop's output: it prints
only the summary line. Short saves print nothing.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..units import format_bytes, format_duration
from .info import CheckpointInfo

logger = logging.getLogger("luopan")

PROGRESS_AFTER = 2.0  # seconds: saves shorter than this print nothing (the log record is still emitted)


@dataclass(frozen=True)
class SaveReport:
    """The figures of one committed save: what ``CheckpointManager.last_save`` holds and ``on_save`` receives.

    ``duration_seconds`` (alias ``save_seconds``): wall seconds from the save call to its commit. ``stall_seconds``:
    seconds the caller was blocked (the duration for a synchronous save; the host copy for ``save_async``). Both
    are None for a checkpoint whose manifest does not record them. ``bytes_written``: bytes of pack files the save
    wrote (after compression); ``new_bytes``: raw bytes of the chunks it added; ``logical_bytes``: bytes of the
    state. ``dedup_ratio``: logical bytes / bytes written (inf when nothing new was written). ``chunks``: the
    chunks the state is made of.
    """

    run: str
    step: int
    stall_seconds: float | None
    duration_seconds: float | None
    bytes_written: int
    new_bytes: int
    logical_bytes: int
    chunks: int = 0

    @property
    def save_seconds(self) -> float | None:
        return self.duration_seconds

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.bytes_written if self.bytes_written else math.inf

    def as_dict(self) -> dict[str, Any]:
        """The figures as a flat dict (``save_seconds`` and ``dedup_ratio`` included): ready for a metrics logger."""
        return {**asdict(self), "save_seconds": self.save_seconds, "dedup_ratio": self.dedup_ratio}

    @classmethod
    def from_info(cls, info: CheckpointInfo) -> SaveReport:
        return cls(info.run, info.step, info.stall_seconds, info.save_seconds, info.stored_bytes, info.new_bytes,
                   info.logical_bytes, info.chunks)

    def line(self) -> str:
        """One line for people: ``run 'a' step 500 committed: 1.2 GiB written (7.7 GiB logical, dedup 6.4x) in 3.41s,
        stall 0.210s``; a save that wrote nothing (the same state again) says so: ``nothing new written (all 12
        chunks already stored, 7.7 GiB logical)``, not a ratio over zero bytes."""
        timing = ""
        if self.duration_seconds is not None:
            timing = f" in {format_duration(self.duration_seconds)}"
            if self.stall_seconds is not None:
                timing += f", stall {format_duration(self.stall_seconds)}"
        head = f"run {self.run!r} step {self.step} committed: "
        logical = f"{format_bytes(self.logical_bytes)} logical"
        if not self.bytes_written:
            stored = (f"all {self.chunks} chunk{'s' if self.chunks != 1 else ''} already stored, " if self.chunks
                      else "")
            return f"{head}nothing new written ({stored}{logical}){timing}"
        return (f"{head}{format_bytes(self.bytes_written)} written ({logical}, dedup {self.dedup_ratio:.1f}x)"
                f"{timing}")


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # replaced by an object without isatty, or closed
        return False


class SaveProgress:
    """The progress of one save: ``advance(n)`` as bytes are hashed (a bar appears once the save has run for
    ``PROGRESS_AFTER`` seconds, on a terminal, for a synchronous save), ``finish(info)`` at the commit (the log
    record, and the summary line of a long save), ``close()`` in any case."""

    def __init__(self, run: str, step: int, total: int, *, started: float, enabled: bool, background: bool,
                 after: float | None = None) -> None:
        self.run, self.step, self.total = run, step, total
        self.started = started
        self.enabled = enabled
        self.after = PROGRESS_AFTER if after is None else after
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        self._may_draw = enabled and not background and _stderr_is_terminal()

    def advance(self, n: int) -> None:
        self.done += n
        if not self._may_draw:
            return
        if self._bar is None:
            if time.monotonic() - self.started < self.after:
                return
            self._start_bar()
        self._bar.update(self._task, completed=min(self.done, self.total))

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TransferSpeedColumn)

        self._bar = Progress(TextColumn("luopan: saving {task.description}"), BarColumn(), DownloadColumn(),
                             TransferSpeedColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                             transient=True)
        self._task = self._bar.add_task(f"{self.run} step {self.step}", total=max(self.total, 1))
        self._bar.start()

    def close(self) -> None:
        bar, self._bar, self._may_draw = self._bar, None, False
        if bar is not None:
            try:
                bar.stop()
            except Exception:  # noqa: BLE001 - a terminal that went away must not fail a committed save
                pass

    def finish(self, info: CheckpointInfo) -> SaveReport:
        """The save is committed: stop the bar, log its record, print its line when it was long."""
        self.close()
        report = SaveReport.from_info(info)
        logger.info("%s", report.line(), extra={"luopan_save": report.as_dict()})
        took = report.duration_seconds
        if self.enabled and took is not None and took >= self.after and not _logging_shows_info():
            try:
                sys.stderr.write(f"luopan: {report.line()}\n")
                sys.stderr.flush()
            except (AttributeError, ValueError, OSError):
                pass
        return report


def _logging_shows_info() -> bool:
    """The ``luopan`` logger's INFO records reach a handler the program configured (then they carry the line)."""
    return logger.isEnabledFor(logging.INFO) and logger.hasHandlers()

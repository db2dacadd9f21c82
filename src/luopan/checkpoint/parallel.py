"""A small ordered, bounded parallel map used by the save and load pipelines.

Hashing (BLAKE3), zstd and file reads release the GIL, so two threads use both cores of a small machine. The
window bounds how far ahead work is submitted, which bounds memory when items materialise host copies.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(2, min(8, os.cpu_count() or 2))


class _Done:
    """An inline result waiting in the queue: what ordered_map needs of a Future (result, cancel) without the lock
    and condition a Future allocates (~3 us per small chunk: 11 ms of a 2,300-tensor LoRA re-save)."""

    __slots__ = ("_value", "_exc")

    def __init__(self, value: Any = None, exc: BaseException | None = None) -> None:
        self._value = value
        self._exc = exc

    def result(self) -> Any:
        if self._exc is not None:
            raise self._exc
        return self._value

    def cancel(self) -> bool:
        return False


def ordered_map(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], window: int,
                inline: Callable[[T], bool] | None = None, group: Callable[[T], int] | None = None,
                group_size: int = 0) -> Iterator[R]:
    """fn over items, results in input order, at most ``window`` work units queued ahead.

    Items for which ``inline`` says so run on the calling thread right away (their results wait in the queue, so
    order is kept). With ``group`` (an item's size) consecutive other items go to a worker together, up to
    ``group_size`` per handoff: one handoff per 4 MiB chunk cost ~15% of an unchanged 1 GiB re-save here.
    """
    pending: deque[Any] = deque()  # Futures of lists (groups) and _Done results, in input order
    batch: list[T] = []
    batch_size = 0

    def run(chunk: list[T]) -> list[R]:
        return [fn(item) for item in chunk]

    def submit() -> None:
        nonlocal batch, batch_size
        if batch:
            pending.append(pool.submit(run, batch))
            batch, batch_size = [], 0

    def ready() -> Iterator[R]:
        while len(pending) >= window:
            head = pending.popleft()
            if isinstance(head, _Done):
                yield head.result()
            else:
                yield from head.result()

    try:
        for item in items:
            if inline is not None and inline(item):
                submit()  # earlier items first, so order holds
                try:
                    pending.append(_Done(fn(item)))
                except BaseException as exc:  # noqa: BLE001 - re-raised in order by .result()
                    pending.append(_Done(exc=exc))
            else:
                batch.append(item)
                batch_size += group(item) if group is not None else group_size
                if batch_size >= group_size:
                    submit()
            yield from ready()
        submit()
        window = 1
        yield from ready()
    finally:
        for f in pending:
            f.cancel()

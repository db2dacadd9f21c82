"""A small ordered, bounded parallel map used by the save and load pipelines.

Hashing (BLAKE3), zstd and file reads release the GIL, so two threads use both cores of a small machine. The
window bounds how far ahead work is submitted, which bounds memory when items materialise host copies.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(2, min(8, os.cpu_count() or 2))


def ordered_map(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], window: int,
                inline: Callable[[T], bool] | None = None) -> Iterator[R]:
    """fn over items, results in input order, at most ``window`` queued ahead. Items for which ``inline`` says so
    run on the calling thread right away (their results wait in the queue, so order is kept)."""
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            if inline is not None and inline(item):
                done: Future[R] = Future()  # run now, but queue the result so order holds without draining
                try:
                    done.set_result(fn(item))
                except BaseException as exc:  # noqa: BLE001 - re-raised in order by .result()
                    done.set_exception(exc)
                pending.append(done)
            else:
                pending.append(pool.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()

"""Repository locks (docs/format.md §9.2): shared for saves, exclusive for prune and gc.

A lock is a small sealed JSON record (luopan.repository.lockrecords) ``locks/<kind>-<id>.json`` naming its holder (host, pid, pid namespace,
process start time, operation) and when it was taken and last refreshed. The protocol needs only ``put``,
``delete`` and ``list``, so it works the same on a local disk, a shared filesystem and an object store:

* **shared** (a save): write our record; list — if a live exclusive lock is there, withdraw ours, wait while one
  exists and start over. Shared holders never exclude each other.
* **exclusive** (prune, gc): wait while any other live lock exists; write our record; list again — if any other
  lock appeared meanwhile, withdraw ours and wait again (two exclusive lockers racing both withdraw and retry after
  a random pause). Whoever writes second always sees the first, so a save and a gc never both proceed.

Only files named like lock records (``locks/<shared|exclusive|waiting>-<16 hex>.json``) are locks: anything else
under ``locks/`` is not luopan's and is neither obeyed nor ever deleted. A holder that cannot delete its record
(the store is unreachable when its save fails) keeps retrying in the background until the store answers.

A holder refreshes its record every ``REFRESH_SECONDS`` while it holds it. A lock is **stale** when its holder is
certainly gone — same host and pid namespace, and that pid is not running or runs a different process (start time
differs) — or when it has not been refreshed for ``STALE_SECONDS``. Locks of dead processes on this host are
removed automatically (with a warning); a lock that is merely old may belong to a hung or partitioned process on
another host, so it blocks until someone breaks it (``luopan unlock``, ``break_locks``) — the error says so.
"""

from __future__ import annotations

import atexit
import errno
import os
import random
import secrets
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import LockedError, StorageError, UsageError, os_remedy
from ..format import BASE_FORMAT_VERSION
from ..format.canonical import seal
from ..format.names import LOCK_NAME, LOCK_PREFIX, lock_key  # noqa: F401  (importable from here)
from ..store.base import Store
from ..store.flocks import FileLock, flock_holders, try_flock
from .lockrecords import (  # noqa: F401  (break_locks, parse_lock, KINDS…: the lock API, importable from here)
    _HOST,
    DEFAULT_TIMEOUT,
    KINDS,
    REFRESH_SECONDS,
    STALE_SECONDS,
    WAITING_SECONDS,
    LockRecord,
    _boot_id,
    _machine_id,
    _pidns,
    _span,
    _start_time,
    break_locks,
    list_locks,
    parse_lock,
)

_orphans: dict[tuple[int, str], tuple[Store, str]] = {}
_orphans_lock = threading.Lock()
_orphan_wakeup = threading.Event()
_orphan_thread: threading.Thread | None = None
_atexit_registered = False
ORPHAN_RETRY_MAX = 15.0  # seconds between retries, at most: a record should not outlive the outage by much


def _retry_later(store: Store, key: str) -> None:
    global _orphan_thread, _atexit_registered
    with _orphans_lock:
        if not _atexit_registered:
            atexit.register(_last_attempt)
            _atexit_registered = True
        _orphans[(id(store), key)] = (store, key)
        if _orphan_thread is None or not _orphan_thread.is_alive():
            _orphan_thread = threading.Thread(target=_retry_loop, name="luopan-lock-release", daemon=True)
            _orphan_thread.start()
    _orphan_wakeup.set()


def retry_releases() -> int:
    """Try once more to delete every lock record a failed release left behind; returns how many remain."""
    with _orphans_lock:
        pending = list(_orphans.items())
    for ident, (store, key) in pending:
        try:
            store.delete(key)
        except OSError:
            continue
        with _orphans_lock:
            _orphans.pop(ident, None)
    with _orphans_lock:
        return len(_orphans)


def _last_attempt() -> None:
    """At interpreter exit: one more try for records still not deleted (another host would otherwise wait for them
    to turn stale, or for `luopan unlock`)."""
    if _orphans:
        retry_releases()


def _retry_loop() -> None:
    pause = 0.5
    while True:
        _orphan_wakeup.wait(pause)
        _orphan_wakeup.clear()
        if retry_releases() == 0:
            pause = 0.5
            with _orphans_lock:
                if not _orphans:
                    global _orphan_thread
                    _orphan_thread = None
                    return
        pause = min(pause * 2, ORPHAN_RETRY_MAX)


class Lock:
    """A held lock: its record is refreshed on a background thread until ``release``."""

    def __init__(self, store: Store, kind: str, op: str) -> None:
        self.store = store
        self.kind = kind
        self.op = op
        self.key = lock_key(kind, secrets.token_hex(8))
        self._created = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return seal({"format_version": BASE_FORMAT_VERSION, "kind": self.kind, "op": self.op, "host": _HOST,
                     "pid": os.getpid(), "pidns": _pidns(), "boot": _boot_id(), "machine": _machine_id(),
                     "started": _start_time(os.getpid()),
                     "created": self._created, "refreshed": time.time()})

    def _write(self) -> None:
        self.store.put(self.key, self._record())
        self._written = time.time()

    def age_now(self) -> float:
        return time.time() - getattr(self, "_written", 0.0)

    def _start_refreshing(self) -> None:
        stop = self._stop = threading.Event()

        def refresh() -> None:
            while not stop.wait(REFRESH_SECONDS):
                try:
                    self._write()
                except OSError as exc:  # keep trying: a missed refresh only matters after STALE_SECONDS
                    warnings.warn(f"could not refresh repository lock {self.key}: {exc}", stacklevel=1)

        self._thread = threading.Thread(target=refresh, name="luopan-lock-refresh", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.store.delete(self.key)
        except OSError as exc:
            try:
                if not self.store.exists(self.key):  # its write failed (a read-only repository): nothing to undo
                    return
            except OSError:
                pass
            _retry_later(self.store, self.key)
            warnings.warn(f"could not remove repository lock {self.key} ({exc}); retrying in the background until "
                          "the store answers", stacklevel=2)

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _survey(store: Store, kind: str, own: str | None) -> tuple[list[LockRecord], list[LockRecord]]:
    """(locks that keep a lock of ``kind`` from being held, fresh waiting markers of blocked saves), after removing
    records whose holder is certainly gone."""
    blockers, waiting = [], []
    for rec in list_locks(store):
        if rec.key == own:
            continue
        if rec.damage is None and rec.holder_gone():
            try:
                store.delete(rec.key)
            except OSError:
                pass
            else:
                if rec.kind != "waiting":
                    warnings.warn(f"removed a stale repository lock ({rec.describe()}: the process is gone)",
                                  stacklevel=4)
                continue
        if rec.kind == "waiting":
            if rec.age < WAITING_SECONDS:
                waiting.append(rec)
        elif not (kind == "shared" and rec.kind == "shared"):
            blockers.append(rec)
    return blockers, waiting


def acquire(store: Store, kind: str, op: str, *, timeout: float | None = DEFAULT_TIMEOUT,
            where: str | None = None) -> Lock:
    """Take a ``kind`` ("shared" or "exclusive") lock for operation ``op``, waiting up to ``timeout`` seconds
    (None: forever) while other holders finish. Raises LockedError naming the holders and how to break a stale one.

    Fair both ways: an exclusive locker keeps its record in place while it waits for shared holders to finish, and
    new shared lockers wait behind it, so a stream of saves cannot starve prune/gc; a save blocked by an exclusive
    lock posts a *waiting* marker, and no new exclusive lock is taken while one is fresh, so a gc loop cannot starve
    saves either. Of two exclusive lockers the older record wins; the younger withdraws until the older is gone.
    """
    if kind not in ("shared", "exclusive"):
        raise UsageError(f"lock kind must be 'shared' or 'exclusive', not {kind!r}")
    if _orphans:
        retry_releases()  # our own records from a failed release must not block us
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.02
    lock = Lock(store, kind, op)
    marker: Lock | None = None  # a shared locker's waiting marker
    posted = False
    # A shared locker writes its record before its first listing: whoever writes second sees the first, so one
    # listing decides (one LIST per save on an object store, issue 30); an exclusive record seen makes it withdraw
    # and wait as below.
    optimistic = kind == "shared"
    try:
        while True:
            blockers, waiting = ([], []) if optimistic else _survey(store, kind, lock.key if posted else None)
            optimistic = False
            if kind == "exclusive":
                ahead = [b for b in blockers if b.kind != "shared" and (b.created, b.key) < (lock._created, lock.key)]
                if posted and ahead:  # an older exclusive locker: give way to it
                    lock.release()
                    posted = False
                elif not posted and not waiting and not [b for b in blockers if b.kind != "shared"]:
                    posted = True  # set first: a write cut off in an outage may still have landed
                    lock._write()
                    lock._start_refreshing()
                    blockers, _ = _survey(store, kind, lock.key)
                if posted and not blockers:
                    return lock
            elif not blockers:
                posted = True  # from here an error (or Ctrl-C) must take the record back
                lock._write()
                blockers = _survey(store, kind, lock.key)[0]
                if not blockers:
                    lock._start_refreshing()
                    return lock
                store.delete(lock.key)  # an exclusive locker came in between: give way, try again
                posted = False
            elif marker is None or marker.age_now() > WAITING_SECONDS / 3:
                if marker is not None:
                    marker.release()
                marker = Lock(store, "waiting", op)
                marker._write()
            if blockers and all(b.damage is not None for b in blockers):
                raise _locked_error(store, kind, op, blockers, where)  # nobody will ever remove them but unlock
            if deadline is not None and time.monotonic() >= deadline:
                raise _locked_error(store, kind, op, blockers or waiting, where)
            time.sleep(pause * (0.5 + random.random()))
            pause = min(pause * 1.5, 0.5)
    except BaseException:
        if posted:
            lock.release()
        raise
    finally:
        if marker is not None:
            marker.release()


def _locked_error(store: Store, kind: str, op: str, blockers: list[LockRecord], where: str | None) -> LockedError:
    repo = where or store.describe()
    lines = []
    stale = False
    for rec in blockers[:10]:
        reason = rec.stale_reason()
        stale |= reason is not None
        lines.append(f"{rec.describe()}" + (f" — looks stale: {reason}" if reason else ""))
    advice = (f"if that process is gone, remove stale locks with `luopan unlock -r {repo}`" if stale else
              f"wait for it to finish, or if you are sure it is gone, `luopan unlock --all -r {repo}`")
    article = "an" if kind == "exclusive" else "a"
    return LockedError(f"cannot take {article} {kind} lock for {op} on {repo}: held by\n  " + "\n  ".join(lines)
                       + f"\n{advice}")


@contextmanager
def locked(store: Store, kind: str, op: str, *, timeout: float | None = DEFAULT_TIMEOUT,
           where: str | None = None) -> Iterator[Lock | FileLock]:
    """Hold a ``kind`` lock for ``op`` (see ``acquire``). On a local filesystem (``store.lock_path()``) a shared lock
    is ``flock(LOCK_SH)`` on ``locks/flock`` — unless a record blocks it (an exclusive locker, or a damaged record),
    then the record protocol decides as before — and an exclusive lock is the record and ``flock(LOCK_EX)``."""
    path = _lock_path(store)
    deadline = None if timeout is None else time.monotonic() + timeout
    if path is not None and kind == "shared":
        try:
            held = try_flock(path, "shared", op, deadline)
        except OSError:  # the lock file cannot be opened (a read-only or full disk): records decide, typed errors
            held = None
        if held is not None:
            if not _survey(store, kind, None)[0]:
                with held:
                    yield held
                return
            held.release()  # a record is in the way: wait on the records, as lockers without flock do
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        path = None
    with acquire(store, kind, op, timeout=timeout, where=where) as record:
        if path is None:
            yield record
            return
        try:
            held = try_flock(path, "exclusive", op, deadline)
        except OSError as exc:
            code = exc.errno or errno.EIO
            raise StorageError(code, f"cannot open the repository's lock file {path} for {op}: "
                               f"{exc.strerror or exc}; {os_remedy(code)}, then try again") from None
        if held is None:
            pids = flock_holders(path)
            repo = where or store.describe()
            raise LockedError(f"cannot take an exclusive lock for {op} on {repo}: a save is running (process "
                              f"{', '.join(map(str, pids)) or 'unknown'} holds {path}); wait for it to finish")
        with held:
            yield record


def _lock_path(store: Store) -> str | None:
    try:
        return store.lock_path()
    except OSError:
        return None

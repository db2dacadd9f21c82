"""Repository locks (docs/format.md §9.2): shared for saves, exclusive for prune and gc.

A lock is a small sealed JSON record ``locks/<kind>-<id>.json`` naming its holder (host, pid, pid namespace,
process start time, operation) and when it was taken and last refreshed. The protocol needs only ``put``,
``delete`` and ``list``, so it works the same on a local disk, a shared filesystem and an object store:

* **shared** (a save): wait while a live exclusive lock exists; write our record; list again — if an exclusive
  lock appeared meanwhile, withdraw ours and wait again. Shared holders never exclude each other.
* **exclusive** (prune, gc): wait while any other live lock exists; write our record; list again — if any other
  lock appeared meanwhile, withdraw ours and wait again (two exclusive lockers racing both withdraw and retry after
  a random pause). Whoever writes second always sees the first, so a save and a gc never both proceed.

A holder refreshes its record every ``REFRESH_SECONDS`` while it holds it. A lock is **stale** when its holder is
certainly gone — same host and pid namespace, and that pid is not running or runs a different process (start time
differs) — or when it has not been refreshed for ``STALE_SECONDS``. Locks of dead processes on this host are
removed automatically (with a warning); a lock that is merely old may belong to a hung or partitioned process on
another host, so it blocks until someone breaks it (``luopan unlock``, ``break_locks``) — the error says so.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .errors import LockedError
from .format import BASE_FORMAT_VERSION
from .format.canonical import SealError, seal, unseal
from .store.base import KeyNotFound, Store

LOCK_PREFIX = "locks/"
REFRESH_SECONDS = 120.0
STALE_SECONDS = 30 * 60.0
DEFAULT_TIMEOUT = 600.0
WAITING_SECONDS = 30.0  # a waiting marker older than this (its save died or gave up) no longer holds gc back


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat.rsplit(b")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_HOST = socket.gethostname()


@dataclass(frozen=True)
class LockRecord:
    key: str
    kind: str  # "shared" | "exclusive" | "waiting" (a save blocked by an exclusive lock: not a lock)
    op: str
    host: str
    pid: int
    pidns: str
    boot: str
    machine: str  # /etc/machine-id: tells "this host rebooted" from "another machine with the same hostname"
    started: int | None  # process start time (clock ticks since boot), or None
    created: float  # unix time
    refreshed: float

    @property
    def age(self) -> float:
        return time.time() - self.refreshed

    def holder_gone(self) -> bool:
        """True when the holder certainly is not running: this very machine (same hostname and machine id) booted
        again since, or, same boot (the boot id is unique to one kernel run) and pid namespace, its pid is gone or
        now runs another process. A machine that merely shares the hostname, or another pid namespace: cannot tell
        (only the age makes it stale)."""
        if self.host != _HOST:
            return False
        if self.boot != _boot_id():  # another boot: of this very machine only if the machine ids say so
            return bool(self.boot) and bool(self.machine) and self.machine == _machine_id()
        if self.pidns != _pidns():  # same kernel (boot id), another pid namespace: its pids mean nothing here
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return self.started is not None and _start_time(self.pid) not in (None, self.started)

    def stale_reason(self) -> str | None:
        if self.holder_gone():
            return f"its process {self.pid} on {self.host} is no longer running"
        if self.age > STALE_SECONDS:
            return f"it has not been refreshed for {_span(self.age)} (stale after {_span(STALE_SECONDS)})"
        return None

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.created, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.kind == "waiting":
            return f"{self.op} by pid {self.pid} on {self.host}, waiting for an exclusive lock to end, since {when}"
        return f"{self.kind} lock for {self.op} by pid {self.pid} on {self.host} since {when}"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "op": self.op, "host": self.host, "pid": self.pid,
                "created": self.created, "refreshed": self.refreshed, "stale": self.stale_reason()}


def _span(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"


def _parse(key: str, data: bytes) -> LockRecord | None:
    try:
        d = unseal(data)
        return LockRecord(key, str(d["kind"]), str(d["op"]), str(d["host"]), int(d["pid"]), str(d["pidns"]),
                          str(d.get("boot", "")), str(d.get("machine", "")), d.get("started"), float(d["created"]), float(d["refreshed"]))
    except (SealError, KeyError, TypeError, ValueError):
        return None


def list_locks(store: Store) -> list[LockRecord]:
    """Every lock record in the repository. A damaged or half-visible record counts as a lock of unknown holder
    (kind "exclusive", age from nothing): it is reported, and only `luopan unlock` removes it."""
    out = []
    for key in store.list(LOCK_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            data = store.get(key)
        except KeyNotFound:
            continue
        rec = _parse(key, data)
        if rec is None:
            rec = LockRecord(key, "exclusive", "unknown (damaged lock record)", "?", -1, "", "", "", None, 0.0, 0.0)
        out.append(rec)
    return out


def break_locks(store: Store, *, stale_only: bool = True) -> list[LockRecord]:
    """Remove lock records (only stale ones unless ``stale_only=False``); returns the ones removed."""
    removed = []
    for rec in list_locks(store):
        if stale_only and rec.stale_reason() is None:
            continue
        store.delete(rec.key)
        removed.append(rec)
    return removed


class Lock:
    """A held lock: its record is refreshed on a background thread until ``release``."""

    def __init__(self, store: Store, kind: str, op: str) -> None:
        self.store = store
        self.kind = kind
        self.op = op
        self.key = f"{LOCK_PREFIX}{kind}-{secrets.token_hex(8)}.json"
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
            warnings.warn(f"could not remove repository lock {self.key} ({exc}); it turns stale on its own "
                          f"or `luopan unlock` removes it", stacklevel=2)

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
        if rec.holder_gone():
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
        raise ValueError(f"lock kind must be 'shared' or 'exclusive', not {kind!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 0.02
    lock = Lock(store, kind, op)
    marker: Lock | None = None  # a shared locker's waiting marker
    posted = False
    try:
        while True:
            blockers, waiting = _survey(store, kind, lock.key if posted else None)
            if kind == "exclusive":
                ahead = [b for b in blockers if b.kind != "shared" and (b.created, b.key) < (lock._created, lock.key)]
                if posted and ahead:  # an older exclusive locker: give way to it
                    lock.release()
                    posted = False
                elif not posted and not waiting and not [b for b in blockers if b.kind != "shared"]:
                    lock._write()
                    posted = True
                    lock._start_refreshing()
                    blockers, _ = _survey(store, kind, lock.key)
                if posted and not blockers:
                    return lock
            elif not blockers:
                lock._write()
                posted = True  # from here an error (or Ctrl-C) must take the record back
                if not _survey(store, kind, lock.key)[0]:
                    lock._start_refreshing()
                    return lock
                store.delete(lock.key)  # an exclusive locker came in between: give way, try again
                posted = False
            elif marker is None or marker.age_now() > WAITING_SECONDS / 3:
                if marker is not None:
                    marker.release()
                marker = Lock(store, "waiting", op)
                marker._write()
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
           where: str | None = None) -> Iterator[Lock]:
    lock = acquire(store, kind, op, timeout=timeout, where=where)
    try:
        yield lock
    finally:
        lock.release()

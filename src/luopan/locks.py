"""Repository locks (docs/format.md §9.2): shared for saves, exclusive for prune and gc.

A lock is a small sealed JSON record ``locks/<kind>-<id>.json`` naming its holder (host, pid, pid namespace,
process start time, operation) and when it was taken and last refreshed. The protocol needs only ``put``,
``delete`` and ``list``, so it works the same on a local disk, a shared filesystem and an object store:

* **shared** (a save): wait while a live exclusive lock exists; write our record; list again — if an exclusive
  lock appeared meanwhile, withdraw ours and wait again. Shared holders never exclude each other.
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
import math
import os
import random
import re
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

from ._process import pid_alive
from .errors import IntegrityError, LockedError, StorageError, UnsupportedFormatError, UsageError
from .format import BASE_FORMAT_VERSION
from .format.canonical import seal, unseal_file
from .format.limits import MAX_SMALL_BYTES
from .store.base import KeyNotFound, Store

LOCK_PREFIX = "locks/"
REFRESH_SECONDS = 120.0
STALE_SECONDS = 30 * 60.0
DEFAULT_TIMEOUT = 600.0
WAITING_SECONDS = 30.0  # a waiting marker older than this (its save died or gave up) no longer holds gc back
KINDS = ("shared", "exclusive", "waiting")
LOCK_NAME = re.compile(r"locks/(shared|exclusive|waiting)-[0-9a-f]{16}\.json", re.ASCII)
MAX_TIME = float(1 << 34)  # unix seconds, year 2514: a later time is damage (or a clock far off), never a lock's


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
    damage: str | None = None  # why the record could not be read: it blocks, and only `luopan unlock` removes it

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
        if not pid_alive(self.pid):
            return True
        return self.started is not None and _start_time(self.pid) not in (None, self.started)

    def stale_reason(self) -> str | None:
        if self.damage is not None:
            return f"the record is damaged ({self.damage})"
        if self.holder_gone():
            return f"its process {self.pid} on {self.host} is no longer running"
        if self.age > STALE_SECONDS:
            return f"it has not been refreshed for {_span(self.age)} (stale after {_span(STALE_SECONDS)})"
        return None

    def describe(self) -> str:
        if self.damage is not None:
            return f"damaged lock record {self.key}"
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


def parse_lock(key: str, data: bytes) -> LockRecord:
    """A lock record, every field checked (kinds, a pid, finite times before MAX_TIME). Raises IntegrityError when
    damaged; UnsupportedFormatError when written by a newer luopan."""
    d = unseal_file(data, f"lock record {key}")  # CorruptRepoError (an IntegrityError) when damaged
    strs = {k: d.get(k, "") for k in ("kind", "op", "host", "pidns", "boot", "machine")}
    pid, started, created, refreshed = d.get("pid"), d.get("started"), d.get("created"), d.get("refreshed")
    ok = (all(isinstance(v, str) for v in strs.values()) and strs["kind"] in KINDS
          and isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31  # a pid_t, never 0 or -1
          and (started is None or (isinstance(started, int) and not isinstance(started, bool) and started >= 0))
          and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 <= t <= MAX_TIME
                  for t in (created, refreshed)))
    if not ok:
        raise IntegrityError(f"lock record {key} is damaged: a field is missing, of the wrong type or out of range "
                             "(e.g. a time past the year 2514)")
    return LockRecord(key, strs["kind"], strs["op"], strs["host"], pid, strs["pidns"], strs["boot"],
                      strs["machine"], started, float(created), float(refreshed))


def _damaged(key: str, why: str) -> LockRecord:
    return LockRecord(key, "exclusive", "unknown", "?", -1, "", "", "", None, 0.0, 0.0, damage=why)


def list_locks(store: Store) -> list[LockRecord]:
    """Every lock record in the repository: files named like lock records directly under ``locks/`` (anything
    else there is not a lock). A damaged record counts as an exclusive lock of unknown holder: it blocks, is
    reported as stale (``damage`` says why), and ``luopan unlock`` removes it."""
    out = []
    for key in store.list_flat(LOCK_PREFIX):  # never below locks/: a link or a tree there is not ours to walk
        if not LOCK_NAME.fullmatch(key):
            continue
        try:
            rec = parse_lock(key, store.get_limited(key, MAX_SMALL_BYTES))
        except KeyNotFound:
            continue
        except UnsupportedFormatError:  # a newer luopan's lock: obey it, never break it as stale
            rec = _unknown(key, "a newer luopan's lock")
        except StorageError as exc:  # unreadable now (permissions, an outage): obey it, never break it as stale
            rec = _unknown(key, f"unreadable: {str(exc)[:200]}")
        except IntegrityError as exc:
            rec = _damaged(key, str(exc).split(": ", 1)[-1][:200])
        out.append(rec)
    return out


def _unknown(key: str, why: str) -> LockRecord:
    """A record that blocks as an exclusive lock, fresh (never stale): only `unlock --all` removes it."""
    now = time.time()
    return LockRecord(key, "exclusive", f"unknown ({why})", "?", -1, "", "", "", None, now, now)


def break_locks(store: Store, *, stale_only: bool = True) -> list[LockRecord]:
    """Remove lock records (only stale ones unless ``stale_only=False``); returns the ones removed."""
    removed = []
    for rec in list_locks(store):  # only files named like lock records: never anything else under locks/
        if stale_only and rec.stale_reason() is None:
            continue
        store.delete(rec.key)
        removed.append(rec)
    return removed


# Records this process failed to delete (the store did not answer): retried in the background until it does, and
# before every new lock is taken, so a save that failed in an outage does not leave gc blocked behind it.
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
    try:
        while True:
            blockers, waiting = _survey(store, kind, lock.key if posted else None)
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
           where: str | None = None) -> Iterator[Lock]:
    lock = acquire(store, kind, op, timeout=timeout, where=where)
    try:
        yield lock
    finally:
        lock.release()

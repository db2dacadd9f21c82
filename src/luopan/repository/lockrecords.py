"""Lock records (docs/format.md §9.2): who holds a repository lock — host, pid, pid namespace, process start time,
boot and machine ids, operation — how a record is parsed, listed and judged stale, and how stale ones are broken.
The locking protocol itself is luopan.repository.locks."""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .._process import pid_alive
from ..errors import IntegrityError, StorageError, UnsupportedFormatError
from ..format.canonical import unseal_file
from ..format.limits import MAX_SMALL_BYTES
from ..format.names import LOCK_NAME, LOCK_PREFIX
from ..store.base import KeyNotFound, Store
from ..units import format_duration

REFRESH_SECONDS = 120.0
STALE_SECONDS = 30 * 60.0
DEFAULT_TIMEOUT = 600.0
WAITING_SECONDS = 30.0  # a waiting marker older than this (its save died or gave up) no longer holds gc back
KINDS = ("shared", "exclusive", "waiting")
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
    """An age for a lock message, in whole seconds: 42s, 5m12s, 30m, 2h3m (luopan.units.format_duration)."""
    return format_duration(max(0, int(seconds)))


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

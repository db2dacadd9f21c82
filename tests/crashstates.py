"""Crash states from a ``powerloss.Recorder``'s record, under the durability model of docs/format.md §10.6 (see
``tests/powerloss.py`` for the model in words). ``check_crash_states(rec, scratch, check)`` replays the record and,
at each crash point, materializes the planned variants into ``scratch`` and calls ``check(state)``."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from .powerloss import _REAL, _REAL_OPEN, PAGE, STATES_PER_OPERATION, TOTAL, Event, Recorder


@dataclass
class _File:
    durable: bytes
    data: bytes


@dataclass
class _Dir:
    durable: dict[str, int]
    entries: dict[str, int]
    pending: list[tuple[int, str, str, int]] = field(default_factory=list)  # (unit, "set"/"del", name, oid)


class Model:
    """The tree as the recorded events left it, with what of it is durable."""

    def __init__(self, rec: Recorder) -> None:
        self.root = rec.base_names[""]
        self.names = dict(rec.base_names)
        self.files = {oid: _File(c, c) for oid, c in rec.base_content.items()}
        self.dirs: dict[int, _Dir] = {}
        for oid in rec.base_dirs:
            self.dirs[oid] = _Dir({}, {})
        for path, oid in rec.base_names.items():
            if path:
                d = self.dirs[rec.base_names[os.path.dirname(path)]]
                d.durable[os.path.basename(path)] = oid
                d.entries[os.path.basename(path)] = oid
        self.acks: list[Any] = []

    def _dir_of(self, path: str) -> tuple[_Dir, str]:
        return self.dirs[self.names[os.path.dirname(path)]], os.path.basename(path)

    def _side(self, unit: int, path: str, op: str, oid: int) -> None:
        d, name = self._dir_of(path)
        if op == "set":
            d.entries[name] = oid
        else:
            d.entries.pop(name, None)
        d.pending.append((unit, op, name, oid))

    def apply(self, unit: int, ev: Event) -> None:
        k = ev.kind
        if k == "create":
            self.files[ev.oid] = _File(b"", b"")
        elif k == "mkdir":
            self.dirs[ev.oid] = _Dir({}, {})
        if k in ("create", "mkdir"):
            self._side(unit, ev.path, "set", ev.oid)
            self.names[ev.path] = ev.oid
        elif k == "data":
            self.files[ev.oid].data = ev.data or b""
        elif k == "fsync":
            if ev.oid in self.files:
                self.files[ev.oid].durable = self.files[ev.oid].data
            else:
                d = self.dirs[ev.oid]
                d.durable, d.pending = dict(d.entries), []
        elif k == "rename":
            self._side(unit, ev.path, "del", ev.oid)
            self._side(unit, ev.dst, "set", ev.oid)
            moved = {p: o for p, o in self.names.items() if p == ev.path or p.startswith(ev.path + os.sep)}
            for p in moved:
                del self.names[p]
            for p in [p for p in self.names if p == ev.dst or p.startswith(ev.dst + os.sep)]:
                del self.names[p]
            for p, o in moved.items():
                self.names[ev.dst + p[len(ev.path):]] = o
        elif k == "link":
            self._side(unit, ev.dst, "set", ev.oid)
            self.names[ev.dst] = ev.oid
        elif k in ("unlink", "rmdir"):
            self._side(unit, ev.path, "del", ev.oid)
            self.names.pop(ev.path, None)
        elif k == "ack":
            self.acks.append(ev.label)

    # -- one crash state ----------------------------------------------------------------------------------------------
    def pending_units(self) -> list[int]:
        return sorted({u for d in self.dirs.values() for (u, *_rest) in d.pending})

    def unsynced_files(self) -> list[int]:
        return [oid for oid, f in self.files.items() if f.durable != f.data]

    def tree(self, applied: Callable[[int], bool], content: Callable[[int, _File], bytes]) -> dict[str, Any]:
        """{relative path: bytes (a file) or None (a directory)} of the state where the pending entry changes for
        which ``applied(unit)`` is true reached the disk and each file holds ``content(oid, file)``."""
        out: dict[str, Any] = {}
        seen_dirs: set[int] = set()
        chosen: dict[int, bytes] = {}

        def walk(oid: int, path: str) -> None:
            seen_dirs.add(oid)
            d = self.dirs[oid]
            entries = dict(d.durable)
            for unit, op, name, child in d.pending:
                if applied(unit):
                    if op == "set":
                        entries[name] = child
                    else:
                        entries.pop(name, None)
            for name in sorted(entries):
                child, sub = entries[name], os.path.join(path, name)
                if child in self.dirs:
                    if child not in seen_dirs:  # a directory reachable twice (a half-applied move): once
                        out[sub] = None
                        walk(child, sub)
                elif child in self.files:
                    if child not in chosen:
                        chosen[child] = content(child, self.files[child])
                    out[sub] = chosen[child]

        walk(self.root, "")
        return out


def _mixed(f: _File, how: str, rng: random.Random) -> bytes:
    """Unsynced bytes of one file as a crash may leave them."""
    d, c = f.durable, f.data
    if how == "durable":
        return d
    if how == "data":
        return c
    if how == "cut" and c.startswith(d):
        return c[: len(d) + rng.randrange(len(c) - len(d) + 1)]
    size = rng.choice((len(d), len(c))) if how != "zeros" else len(c)
    out = bytearray(size)
    for start in range(0, size, PAGE):
        page_d, page_c = d[start:start + PAGE], c[start:start + PAGE]
        if how == "zeros":  # what changed since the sync reads as zeros; what the sync covered stays intact
            page = page_d if page_d == page_c else bytes(
                x if i < len(page_d) and page_d[i] == x else 0 for i, x in enumerate(page_c))
        else:
            page = rng.choice((page_d, page_c))
        page = page[: size - start]
        out[start:start + len(page)] = page
    return bytes(out)


@dataclass
class CrashState:
    root: str  # the materialized world
    acks: list[Any]
    point: int
    variant: str
    events: list[Event]

    def describe(self) -> str:
        tail = "; ".join(str(e) for e in self.events[max(0, self.point - 6):self.point])
        return f"crash after event {self.point}/{len(self.events)} ({self.variant}); last events: {tail}"


def _materialize(tree: dict[str, Any], dest: str) -> None:
    if os.path.exists(dest):
        shutil.rmtree(dest)
    _REAL["mkdir"](dest)
    for path in sorted(tree):
        full = os.path.join(dest, path)
        if tree[path] is None:
            _REAL["mkdir"](full)
        else:
            with _REAL_OPEN(full, "wb") as fh:
                fh.write(tree[path])


def _signature(tree: dict[str, Any], acks: list[Any]) -> bytes:
    h = hashlib.blake2b(repr(acks).encode(), digest_size=16)
    for path in sorted(tree):
        h.update(path.encode() + b"\0")
        h.update(b"D" if tree[path] is None else hashlib.blake2b(tree[path], digest_size=16).digest())
    return h.digest()


@contextmanager
def after_reboot() -> Iterator[None]:
    """The machine booted again: every process that ran before the crash is gone, so a lock record left by one
    (this test's own pid, still alive) is stale, as it is after a real power loss (a new kernel boot id). Records
    written after the reboot carry the new boot id and are judged as usual."""
    from luopan.repository import lockrecords

    before, boot = lockrecords._boot_id(), str(uuid.uuid4())
    judge = lockrecords.LockRecord.holder_gone

    def holder_gone(record: Any) -> bool:
        return record.boot == before or judge(record)

    with mock.patch("luopan.repository.lockrecords._boot_id", lambda: boot), \
            mock.patch("luopan.repository.locks._boot_id", lambda: boot), \
            mock.patch.object(lockrecords.LockRecord, "holder_gone", holder_gone), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="removed a stale repository lock")
        yield


def _sweep(rec: Recorder, points: list[int], seen: set[bytes], dest: str, check: Callable[[CrashState], None],
           seed: int, round_: int, budget: int) -> int:
    """One pass over the record: at each of ``points``, check new crash states (round 0 starts with the extremes),
    an even share of ``budget`` each (a point with little unsynced has few states, and leaves its share to the
    points after it). Returns how many were checked."""
    events, model, checked = rec.events, Model(rec), 0
    wanted = set(points)
    for k in range(len(events) + 1):
        if k:
            model.apply(k - 1, events[k - 1])
        if k not in wanted:
            continue
        quota = max(1, (budget - checked) // max(1, len([p for p in points if p >= k])))
        found = 0
        extremes = ("undone", "kept") if round_ == 0 else ()
        for attempt in range(len(extremes) + 3 * quota):  # random variants often repeat a state: try a few more
            variant = extremes[attempt] if attempt < len(extremes) else f"random-{round_}-{attempt}"
            vr = random.Random(f"{seed}-{k}-{variant}")
            if variant == "undone":
                tree = model.tree(lambda u: False, lambda o, f: f.durable)
            elif variant == "kept":
                tree = model.tree(lambda u: True, lambda o, f: f.data)
            else:
                units = {u for u in model.pending_units() if vr.random() < 0.5}
                how = {o: vr.choice(("durable", "data", "cut", "zeros", "pages")) for o in model.unsynced_files()}
                tree = model.tree(units.__contains__, lambda o, f: _mixed(f, how.get(o, "data"), vr))
            sig = _signature(tree, model.acks)
            if sig in seen:
                continue
            seen.add(sig)
            _materialize(tree, dest)
            state = CrashState(dest, list(model.acks), k, variant, events)
            try:
                with after_reboot():
                    check(state)
            except Exception as exc:
                raise AssertionError(f"{state.describe()}: {type(exc).__name__}: {exc}") from exc
            checked += 1
            found += 1
            if found >= quota or checked >= budget:
                break
        if checked >= budget:
            break
    return checked


def check_crash_states(rec: Recorder, scratch: str | os.PathLike[str], check: Callable[[CrashState], None], *,
                       budget: int | None = None, seed: int = 0) -> int:
    """Check crash states of ``rec``'s record with ``check`` (which raises on a bad state); returns how many distinct
    states were checked. At most ``budget`` (default ``STATES_PER_OPERATION``) states: every crash point gets the
    two extreme variants (when the budget allows), then rounds of random variants share out what is left, until
    the budget is spent or a round finds no new state."""
    budget = STATES_PER_OPERATION if budget is None else budget
    events, rng = rec.events, random.Random(seed)
    points = list(range(len(events) + 1))
    if 2 * len(points) > budget:
        points = sorted(rng.sample(points, max(1, budget // 2)))
    seen: set[bytes] = set()
    dest = os.path.join(os.fspath(scratch), "state")
    checked = 0
    for round_ in range(8):
        found = _sweep(rec, points, seen, dest, check, seed, round_, budget - checked)
        checked += found
        if checked >= budget or (round_ and not found):
            break
    shutil.rmtree(dest, ignore_errors=True)
    TOTAL["states"] += checked
    TOTAL["operations"] += 1
    return checked

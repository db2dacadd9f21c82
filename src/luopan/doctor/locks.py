"""Locks and clocks: stale or damaged lock records (docs/format.md §9.2), and clocks that disagree.

A stale lock blocks prune and gc (and a stale exclusive one every save) until its holder's record is removed; a
damaged record blocks until ``luopan unlock``. Staleness is judged by time (a record not refreshed for 30 min), and
gc's grace period and retention by age compare times written on one host with the clock of another: a lock record or
checkpoint dated in the future, or a record whose file was written at another time than it says, shows a clock off.
"""

from __future__ import annotations

from datetime import datetime

from ..errors import LuopanError
from ..repository.lockrecords import STALE_SECONDS, LockRecord
from ..units import format_duration
from .context import Context
from .finding import Finding, listed, ok, plural, warn

SKEW_SECONDS = 60.0  # more than a refresh's write latency; far less than the 30 min after which a lock is stale


def _unreadable(rec: LockRecord) -> bool:
    return rec.damage is None and rec.pid == -1  # a newer luopan's record, or one that cannot be read now


def check_locks(ctx: Context) -> list[Finding]:
    recs = [r for r in ctx.locks() if r.kind != "waiting"]  # a waiting marker is not a lock; it expires in 30 s
    damaged = [r for r in recs if r.damage is not None]
    unreadable = [r for r in recs if _unreadable(r)]
    rest = [r for r in recs if r.damage is None and not _unreadable(r)]
    gone = [r for r in rest if r.holder_gone()]
    old = [r for r in rest if not r.holder_gone() and r.age > STALE_SECONDS]
    live = [r for r in rest if r not in gone and r not in old]
    out = []
    unlock = ctx.command("unlock")
    if gone:
        out.append(warn("locks", f"{plural(len(gone), 'stale lock')} (holders dead: "
                                 f"{listed([r.describe() for r in gone])})",
                        f"run {unlock} (a save on this host also removes them)"))
    if old:
        out.append(warn("locks", f"{plural(len(old), 'lock')} not refreshed for over {format_duration(STALE_SECONDS)} "
                                 f"(a hung process, or one on another host that is gone: "
                                 f"{listed([r.describe() for r in old])}); prune and gc wait for them",
                        f"if those processes are gone, run {unlock}"))
    if damaged:
        out.append(warn("locks", f"{plural(len(damaged), 'damaged lock record')} "
                                 f"({listed([r.key for r in damaged])}): each blocks every save, prune and gc",
                        f"run {unlock} (it removes damaged records)"))
    if unreadable:
        out.append(warn("locks", f"{plural(len(unreadable), 'lock record')} that cannot be read "
                                 f"({listed([f'{r.key}: {r.op}' for r in unreadable])}); they block like "
                                 "exclusive locks", "check the files' permissions, or upgrade luopan if a newer one "
                                                    f"wrote them; only when no luopan process uses the repository, "
                                                    f"{ctx.command('unlock --all')}"))
    if not out:
        held = f"; {plural(len(live), 'lock')} held by running processes ({listed([r.describe() for r in live])})"
        out.append(ok("locks", "no stale or damaged locks" + (held if live else "")))
    return out


def check_clock(ctx: Context) -> list[Finding]:
    now = ctx.now()
    skewed = []
    dated = 0
    for rec in ctx.locks():
        if rec.damage is not None or _unreadable(rec):
            continue
        dated += 1
        ahead = max(rec.created, rec.refreshed) - now
        if ahead > SKEW_SECONDS:
            skewed.append(f"{rec.describe()} is dated {format_duration(ahead)} in the future (host {rec.host})")
            continue
        if rec.created - rec.refreshed > SKEW_SECONDS:
            skewed.append(f"{rec.describe()} says it was refreshed {format_duration(rec.created - rec.refreshed)} "
                          f"before it was taken (host {rec.host})")
            continue
        try:
            written = ctx.local.modified(rec.key)
        except (LuopanError, OSError):
            written = None
        if written is not None and abs(rec.refreshed - written) > SKEW_SECONDS:
            off = rec.refreshed - written
            skewed.append(f"{rec.describe()} was stored {format_duration(abs(off))} "
                          f"{'before' if off > 0 else 'after'} the time it records (the clock of host {rec.host} "
                          "and the storage's disagree)")
    for n in ctx.newest():
        created = n.doc.get("created") if n.doc is not None else None
        if not isinstance(created, str):
            continue
        dated += 1
        try:
            ahead = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() - now
        except ValueError:
            continue
        if ahead > SKEW_SECONDS:
            skewed.append(f"{n.label()} was created {format_duration(ahead)} in the future")
    if skewed:
        return [warn("clock", f"clocks disagree: {listed(skewed)}; stale-lock detection, gc's grace period and "
                              "time-based retention compare times across hosts",
                     "synchronize the clocks of every host that uses the repository (NTP: `timedatectl`, "
                     "`chronyc tracking`)")]
    if not dated:
        return [ok("clock", "no lock record or checkpoint time to compare this host's clock with")]
    return [ok("clock", f"no lock record or newest checkpoint dated in the future (checked {dated}, "
                        f"tolerance {format_duration(SKEW_SECONDS)})")]

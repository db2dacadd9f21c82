"""What interrupted writes leave behind, and what is not luopan's.

Every local write goes through a temp file beside its destination, ``<name>.tmp-<host>-<pid>-<random>``, renamed
into place once complete (luopan.store.local, docs/format.md §2). A writer killed before the rename leaves it: never
read, but it holds disk space. Opening the repository (any luopan command) removes those whose writer is gone;
doctor, which only reads, counts them. Entries that are not luopan's (``luopan verify`` lists them) are skipped by
every command; an unreadable one (a dangling link) may hide checkpoints, and gc refuses to run past it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .._process import pid_alive
from ..store.local import STALE_TMP_SECONDS, LocalStore
from ..store.walk import TMP_MARK, walk
from ..units import format_bytes
from .context import Context
from .finding import Finding, listed, ok, plural, warn

_HOST = socket.gethostname().replace("-", "_")  # as luopan.store.local writes it into temp names


@dataclass(frozen=True)
class Temp:
    path: str  # relative to the repository
    size: int
    age: float
    abandoned: bool  # its writer is gone (a dead pid of this host), or it is too old to be a write in progress


def temporaries(root: str, now: float) -> list[Temp]:
    """Temp files of writes under ``root`` (following links, as every listing does)."""
    out = []
    for path, stray in walk(root, "", temporaries=True):
        if stray is not None or TMP_MARK not in os.path.basename(path):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # renamed or removed meanwhile
        owner = os.path.basename(path).rsplit(TMP_MARK, 1)[1].split("-")
        age = now - st.st_mtime
        try:
            here, alive = owner[0] == _HOST, pid_alive(int(owner[1]))
        except (IndexError, ValueError):
            here = alive = False
        # a writer of this host: gone iff its pid is; of another host: too old to be a write in progress
        abandoned = not alive if here else age > STALE_TMP_SECONDS
        out.append(Temp(os.path.relpath(path, root), st.st_size, age, abandoned))
    return sorted(out, key=lambda t: t.path)


def check_temporaries(ctx: Context) -> list[Finding]:
    if not isinstance(ctx.local, LocalStore):
        return [ok("leftovers", f"{ctx.where} is an object store: writes leave no temp files there")]
    temps = temporaries(ctx.local.root, ctx.now())
    left = [t for t in temps if t.abandoned]
    busy = [t for t in temps if not t.abandoned]
    note = (f"; {plural(len(busy), 'temp file')} of writes that may be in progress ({listed([t.path for t in busy])})"
            if busy else "")
    if not left:
        return [ok("leftovers", "no temp files of interrupted writes" + note)]
    size = sum(t.size for t in left)
    return [warn("leftovers", f"{plural(len(left), 'temp file')} of interrupted writes ({format_bytes(size)}: "
                              f"{listed([t.path for t in left])}){note}",
                 f"opening the repository removes those whose writer is gone: run any luopan command on it, e.g. "
                 f"{ctx.command('ls')}")]


def check_strays(ctx: Context) -> list[Finding]:
    strays = ctx.repo.checkpointing.strays(everywhere=True)
    unreadable = [s for s in strays if s.unreadable]
    foreign = [s for s in strays if not s.unreadable]
    out = []
    if unreadable:
        out.append(warn("strays", f"{plural(len(unreadable), 'entry', 'entries')} cannot be read "
                                  f"({listed([str(s) for s in unreadable])}): checkpoints there are not seen, and gc "
                                  "will not run", "mount or restore what the links point to, fix the permissions, "
                                                  "or remove the entries"))
    if foreign:
        out.append(warn("strays", f"{plural(len(foreign), 'entry', 'entries')} in the repository "
                                  f"{'is' if len(foreign) == 1 else 'are'} not luopan's and skipped by every command "
                                  f"({listed([str(s) for s in foreign])})",
                        f"move them out of the repository (luopan never reads or deletes them; "
                        f"{ctx.command('verify')} lists them all)"))
    return out or [ok("strays", "nothing in the repository that is not luopan's")]

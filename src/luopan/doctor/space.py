"""Free space against the next checkpoint: a save first checks that the disk has ``space_margin`` (1.5) times the
bytes it expects to write (docs/format.md §10.4, luopan.repository.preflight). Doctor sizes the next checkpoint as
the largest newest checkpoint of any run (the preflight's first estimate: the state's logical size)."""

from __future__ import annotations

import math

from ..errors import LuopanError
from ..repository.preflight import OVERHEAD, freeing_hints, reclaimable
from ..units import format_bytes
from .context import Context
from .finding import Finding, ok, warn


def check_space(ctx: Context) -> list[Finding]:
    free = ctx.free_bytes(ctx.local)
    if free is None:
        return [ok("space", f"free space of {ctx.where} unknown (an object store has no fixed size): not checked")]
    sized = [(n.doc["stats"]["logical_bytes"], n) for n in ctx.newest()
             if n.kind.name == "checkpoint" and n.doc is not None
             and isinstance(n.doc.get("stats", {}).get("logical_bytes"), int)]
    if not sized:
        return [ok("space", f"{format_bytes(free)} free on {ctx.where}; no checkpoint yet to size the next one by")]
    logical, newest = max(sized, key=lambda s: s[0])
    margin = ctx.repo.space_margin or 1.0
    needed = math.ceil((logical + OVERHEAD) * margin)
    basis = f"{margin:g}× {newest.label()}'s {format_bytes(logical)}"
    if free >= needed:
        return [ok("space", f"{format_bytes(free)} free on {ctx.where}; a next checkpoint needs at most "
                            f"{format_bytes(needed)} ({basis})")]
    return [warn("space", f"only {format_bytes(free)} free on {ctx.where}, less than the {format_bytes(needed)} a "
                          f"next checkpoint may need ({basis}): a save that changes most of its bytes will be "
                          "refused (InsufficientSpaceError)", _how_to_free(ctx))]


def _how_to_free(ctx: Context) -> str:
    try:
        gc_frees, prune_frees = reclaimable(ctx.repo)
    except (LuopanError, OSError):
        gc_frees = prune_frees = 0
    ways = freeing_hints(gc_frees, prune_frees, ctx.where)
    ways.append("or free space elsewhere on that disk" if ways else "free space elsewhere on that disk (gc and "
                                                                   "prune would free nothing here)")
    return "; ".join(ways)

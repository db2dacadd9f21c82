"""Checkpoints not yet replicated (tiered repositories, docs/format.md §10.2): a checkpoint only on the local disk
is lost with it. Read from the local records (``tier/replicated/…`` naming the manifest copied): the remote is not
contacted, so doctor answers the same when it is down."""

from __future__ import annotations

from ..errors import LuopanError
from ..repository.tiermarks import Item, Records
from ..repository.tiersetup import read_tier_config
from .context import Context
from .finding import Finding, listed, ok, plural, warn


def _grouped(items: list[Item]) -> list[str]:
    """``run 'a' steps 2, 3`` per series."""
    by: dict[tuple[str, str], list[int]] = {}
    nouns = {}
    for it in items:
        by.setdefault((it.kind.name, it.series), []).append(it.number)
        nouns[(it.kind.name, it.series)] = (it.kind.series_noun, it.kind.number_noun)
    out = []
    for key, numbers in by.items():
        series_noun, number_noun = nouns[key]
        shown = ", ".join(map(str, sorted(numbers)[:8])) + (", …" if len(numbers) > 8 else "")
        out.append(f"{series_noun} {key[1]!r} {number_noun}{'s' if len(numbers) > 1 else ''} {shown}")
    return out


def check_replication(ctx: Context) -> list[Finding]:
    """Nothing for an untiered repository (or one with only a cold store)."""
    try:
        recorded = read_tier_config(ctx.local) or {}
    except LuopanError as exc:
        return [warn("replication", f"the tier settings cannot be read: {exc}",
                     "re-run `luopan replicate --to URL` with the remote's URL to record them again")]
    remote = recorded.get("replicate_to")
    if not remote:
        return []
    records = Records(ctx.local)
    missing: list[Item] = []
    copying: list[Item] = []
    total = 0
    for kind in ctx.repo.kinds:
        for series, number in kind.scan(ctx.local, None, False).pairs():
            item = Item(kind, series, number)
            total += 1
            if records.confirmed(item):
                continue
            (copying if records.pending_elsewhere(item) else missing).append(item)
    now = f"; {plural(len(copying), 'manifest')} being replicated now ({listed(_grouped(copying))})" if copying else ""
    if missing:
        what = "checkpoint" if all(i.kind.name == "checkpoint" for i in missing) else "checkpoint or artifact version"
        return [warn("replication", f"{plural(len(missing), what, what + 's')} not yet replicated to {remote} "
                                    f"({listed(_grouped(missing))}){now}: only this disk holds them",
                     f"run {ctx.command('replicate')} (it resumes, and waits until the remote confirms each)")]
    return [ok("replication", f"{plural(total, 'local manifest')}, all confirmed on {remote}{now}")]

"""Do the journals' and index op logs' segments still read (docs/format.md §16)? Every frame checked, as opening the
log read-only would: damage fails (the log refuses to open); a torn tail a crash left is reported (the next writer
cuts it)."""

from __future__ import annotations

from ..repository.logcheck import check_logs
from .context import Context
from .finding import Finding, fail, ok, plural, warn


def check_journal_logs(ctx: Context) -> list[Finding]:
    report = check_logs(ctx.repo.store, [k.root for k in ctx.repo.kinds])
    if report.logs == 0:
        return []
    out = [fail("logs", f"{p}", "restore the damaged segment from a copy, or follow the error's steps to give up the "
                "records from the damaged one on") for p in report.problems]
    out += [warn("logs", f"a crash left a torn tail: {t}", "nothing to do: the next writer cuts it (no record "
                 "acknowledged as durable is in it)") for t in report.torn]
    if not report.problems:
        out.insert(0, ok("logs", f"{plural(report.logs, 'log')} read: {plural(report.records, 'record')}, every "
                                 "frame intact"))
    return out

"""``luopan doctor``: check a repository for what commonly makes checkpoints fail or be lost, and say what to do.

    findings = luopan.doctor.run_checks("ckpts")
    for f in findings:
        print(f.status, f.check, f.line())

Checks, in order: free space against the next checkpoint, stale or damaged locks, the newest checkpoint of each run
(sampled BLAKE3 verification), replication (tiered repositories), temp files of interrupted writes, entries that
are not luopan's, the filesystem's durability, the format version, and clocks. Doctor only reads: it opens the
repository without the temp-file cleanup ``luopan.open`` does, and never contacts a remote tier.
"""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Callable

from ..errors import LuopanError
from ..repository.core import Repository
from ..store import Store
from . import filesystem
from .context import Context, open_readonly
from .filesystem import check_filesystem
from .finding import Finding, exit_code
from .formatversion import check_format
from .leftovers import check_strays, check_temporaries
from .locks import check_clock, check_locks
from .logs import check_journal_logs
from .space import check_space
from .tiers import check_replication
from .verifying import check_newest

__all__ = ["CHECKS", "Finding", "exit_code", "run_checks"]

CHECKS: tuple[tuple[str, Callable[[Context], list[Finding]]], ...] = (
    ("space", check_space),
    ("locks", check_locks),
    ("verify", check_newest),
    ("logs", check_journal_logs),
    ("replication", check_replication),
    ("leftovers", check_temporaries),
    ("strays", check_strays),
    ("filesystem", check_filesystem),
    ("format", check_format),
    ("clock", check_clock),
)


def default_free_bytes(store: Store) -> int | None:
    """The free-space probe: bytes free to this user on the store's disk (None for an object store)."""
    return store.free_bytes()


def run_checks(
    repo_or_path: Repository | Any | str | os.PathLike[str] | Store,
    *,
    full: bool = False,
    free_bytes: Callable[[Store], int | None] | None = None,
    mount_of: Callable[[str], filesystem.Mount | None] | None = None,
    now: Callable[[], float] | None = None,
) -> list[Finding]:
    """Every check's findings for a repository (an open ``luopan.Repo``, or its path/URL: then opened read-only;
    RepoNotFoundError when there is none). ``full`` reads every chunk of each newest checkpoint instead of a sample.
    ``free_bytes(store)``, ``mount_of(path)`` and ``now()`` replace the probes of free space, the filesystem a path
    is on (luopan.doctor.filesystem.Mount) and the clock. A check that cannot run reports a warning."""
    owned = isinstance(repo_or_path, (str, os.PathLike, Store))
    repo = open_readonly(repo_or_path) if owned else repo_or_path
    ctx = Context(repo, full, free_bytes or default_free_bytes, mount_of or filesystem.mount_of, now or time.time)
    findings: list[Finding] = []
    try:
        for name, check in CHECKS:
            try:
                findings += check(ctx)
            except (LuopanError, OSError, LookupError, TypeError, ValueError) as exc:
                findings.append(Finding(name, "warn", f"the {name} check could not run: {exc}",
                                        "fix the cause, then run `luopan doctor` again"))
    finally:
        if owned:
            repo.close()
    return findings

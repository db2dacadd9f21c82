"""Checking the append-only logs kept in a local repository (journals, a LangGraph saver's journal, index op logs:
docs/format.md §16) for ``verify``, ``check`` and ``doctor``: every segment of every log read and every frame checked
as opening it read-only would, nothing cut. Kind-agnostic: a log is any directory under a kind's root that holds
segment files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import CorruptJournalError, LuopanError, UnreadableError
from ..format.records import segment_seq
from .walscan import Recovery, scan_directory


@dataclass
class LogReport:
    """What checking the logs found: ``problems`` (damage, unreadable files: the log would refuse to open) and
    ``torn`` (torn tails a crash left: the next writer cuts them; nothing acknowledged as durable is in them)."""

    logs: int = 0
    records: int = 0
    problems: list[LuopanError] = field(default_factory=list)
    torn: list[Recovery] = field(default_factory=list)


def local_root(store: object) -> str | None:
    """The directory of a local (or tiered, whose local part is) store; None for an object store (which holds no
    logs: they need a filesystem)."""
    local = getattr(store, "local", store)
    root = getattr(local, "root", None)
    return root if isinstance(root, str) and os.path.isdir(root) else None


def log_directories(root: str, prefixes: Iterable[str]) -> list[str]:
    """Every directory under ``root/<prefix>`` that holds a log segment, sorted."""
    found: set[str] = set()
    for prefix in prefixes:
        top = os.path.join(root, *prefix.strip("/").split("/"))
        for where, _dirs, files in os.walk(top):
            if any(segment_seq(f) is not None for f in files):
                found.add(where)
    return sorted(found)


def check_logs(store: object, prefixes: Iterable[str]) -> LogReport:
    """Read and check every log under the ``prefixes`` (the kinds' roots) of ``store``."""
    report = LogReport()
    root = local_root(store)
    if root is None:
        return report
    for directory in log_directories(root, prefixes):
        report.logs += 1
        where = os.path.relpath(directory, root)
        try:
            segments, torn = scan_directory(directory, cut=False)
        except CorruptJournalError as exc:
            report.problems.append(exc)
            continue
        except (LuopanError, OSError) as exc:
            report.problems.append(UnreadableError(f"the log {where} cannot be read: {exc}"))
            continue
        report.records += sum(len(s.offsets) for s in segments)
        report.torn += torn
    return report


def log_problems(repo: object) -> list[LuopanError]:
    """The problems of every log of a repository (its kinds' roots); for verify and check."""
    store = getattr(repo, "store", None)
    return check_logs(store, [k.root for k in getattr(repo, "kinds", ())]).problems

"""Journal names and keys (docs/format.md §16)."""

from __future__ import annotations

import re

from ..errors import InvalidNameError

JOURNALS = "journals/"
SNAPSHOTS = "_v"
LOG_DIR = "log"
JOURNAL_PINS = "refs/pins/_journals/"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


def is_journal_name(name: object) -> bool:
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None and ".tmp-" not in name


def check_journal(name: object) -> str:
    if not is_journal_name(name):
        raise InvalidNameError(f"invalid journal name {name!r}: use 1-128 characters of A-Z a-z 0-9 . _ -, starting "
                               "with a letter or digit (e.g. 'agent-main')")
    return name  # type: ignore[return-value]


def snapshot_key(name: str, seq: int) -> str:
    return f"{JOURNALS}{name}/{SNAPSHOTS}/{seq:08d}.json"


def snapshot_pin_key(name: str, seq: int) -> str:
    return f"{JOURNAL_PINS}{name}/{seq:08d}.json"


def log_prefix(name: str) -> str:
    return f"{JOURNALS}{name}/{LOG_DIR}/"

"""Index names and every key of the index kind (docs/format.md §17.1)."""

from __future__ import annotations

from ..errors import InvalidNameError
from ..format.names import is_artifact_name

INDEXES = "indexes/"
VERSIONS = "_v"
LOG_DIR = "log"  # indexes/<name>/log/: the op log (local repositories)
INDEX_PINS = "refs/pins/_indexes/"
CURRENT_REFS = "refs/indexes/"
CURRENT_NAME = "current.json"
RESERVED_PARTS = (LOG_DIR, CURRENT_NAME)  # never a part of a name after the first: the log and ref keys stay unique


def is_index_name(name: object) -> bool:
    """Artifact-name rules (run names joined by '/'), and no part after the first is 'log' or 'current.json'."""
    return is_artifact_name(name) and not any(p in RESERVED_PARTS for p in str(name).split("/")[1:])


def check_index(name: object) -> str:
    """An index name, e.g. 'kb-main' or 'kb/main': parts of 1-128 ASCII letters, digits, '.', '_' and '-' joined by
    '/' (as artifact names)."""
    if not is_index_name(name):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80]) + "…"
        raise InvalidNameError(
            f"invalid index name {shown}: use parts of 1-128 ASCII letters, digits, '.', '_' and '-' (each starting "
            "with a letter or digit, without '.tmp-') joined by '/', at most 8 parts and 256 characters, no part "
            "after the first named 'log' or 'current.json' (e.g. 'kb-main')")
    return name  # type: ignore[return-value]


def index_manifest_key(name: str, version: int) -> str:
    return f"{INDEXES}{name}/{VERSIONS}/{version:08d}.json"


def index_pin_key(name: str, version: int) -> str:
    return f"{INDEX_PINS}{name}/{version:08d}.json"


def current_ref_key(name: str) -> str:
    return f"{CURRENT_REFS}{name}/{CURRENT_NAME}"


def log_prefix(name: str) -> str:
    return f"{INDEXES}{name}/{LOG_DIR}/"

"""luopan's own files inside a checked-out folder: the checkout record and the temporary files of a checkout under
way (docs/format.md §8.2.1). They are never data: a commit of the folder skips them, ``status`` does not list them."""

from __future__ import annotations

RECORD = ".luopan-checkout.json"
RECORD_TMP = RECORD + ".tmp-"  # the record's temporary names (luopan._files.write_atomic), at the folder's root
FILE_TMP_PREFIX = ".luopan-tmp-"  # a file of an in-place checkout before it is renamed over its path
OWN_FILES = f"a path luopan keeps for its own files in a checked-out folder ({RECORD}, {FILE_TMP_PREFIX}*)"


def is_luopans(rel: str) -> bool:
    """Whether ``rel``, a path relative to the folder, is one of luopan's own files."""
    name = rel.rpartition("/")[2]
    return rel == RECORD or rel.startswith(RECORD_TMP) or name.startswith(FILE_TMP_PREFIX)

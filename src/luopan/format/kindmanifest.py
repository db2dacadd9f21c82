"""What every kind's manifest parser checks first (docs/format.md §2a, §4, §8): the sealed JSON opened and its
checksum verified, the top-level members typed, the created time, and chunk rows well-formed. Each kind's parser
(artifact, journal, index) adds what its own manifest means."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..errors import CorruptManifestError
from . import refuse_newer
from .canonical import SealError, parse_object, verify_seal
from .names import is_hex64
from .pack import CODECS

_HEX = frozenset("0123456789abcdef")


def open_manifest(data: bytes, where: str, what: str) -> dict[str, Any]:
    """The verified document of a sealed manifest; CorruptManifestError ("<what> <where> is damaged: …") otherwise,
    UnsupportedFormatError when it is newer than this luopan."""
    try:
        obj = parse_object(data)
        refuse_newer(obj, where)
        return verify_seal(obj)
    except SealError as exc:
        raise CorruptManifestError(f"{what} {where} is damaged: {exc}") from None


def check_members(doc: dict[str, Any], spec: dict[str, type], bad: Callable[[str], Exception]) -> None:
    """Each member of ``spec`` present with its type (an int is never a bool)."""
    for key, kind in spec.items():
        value = doc.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(f"member {key!r} is missing or not a {kind.__name__}")


def check_created(doc: dict[str, Any], bad: Callable[[str], Exception]) -> None:
    try:
        created = datetime.fromisoformat(doc["created"].replace("Z", "+00:00"))
    except ValueError:
        created = None
    if created is None or created.utcoffset() is None:
        raise bad("its created time is not an ISO-8601 time with a timezone")


def is_uint(x: object, bound: int = 1 << 62) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < bound


def chunk_row_ok(row: object, bound: int = 1 << 62) -> bool:
    """A chunk row ``[hash, pack index, offset, length, size, codec, xxh3-128]`` of the right types (§8)."""
    return (isinstance(row, list) and len(row) == 7 and is_hex64(row[0]) and all(is_uint(x, bound) for x in row[1:5])
            and row[5] in CODECS and isinstance(row[6], str) and len(row[6]) == 32 and _HEX.issuperset(row[6]))

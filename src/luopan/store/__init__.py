"""Stores: where a repository's bytes live. ``open_store`` picks a backend from a path or URL."""

from __future__ import annotations

import os

from ..errors import InvalidNameError
from .base import KeyNotFound, Store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["KeyNotFound", "LocalStore", "MemoryStore", "Store", "open_store"]


def open_store(location: str | os.PathLike[str] | Store) -> Store:
    """A Store for a local path, ``file://`` URL, ``memory://`` (fresh, empty) or an existing Store."""
    if isinstance(location, Store):
        return location
    loc = os.fspath(location)
    if "://" not in loc:
        return LocalStore(loc)
    scheme, rest = loc.split("://", 1)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "memory":
        return MemoryStore()
    raise InvalidNameError(
        f"unsupported repository URL scheme {scheme!r} in {loc!r}: use a local path, file:// or memory:// "
        "(object-store backends are not available in this version)"
    )

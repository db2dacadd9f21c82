"""Stores: where a repository's bytes live. ``open_store`` picks a backend from a path or URL."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidNameError
from .base import KeyNotFound, Store
from .fsspec_store import OBJECT_STORE_SCHEMES, FsspecStore, is_object_url  # fsspec/s3fs imported on first use
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["FsspecStore", "KeyNotFound", "LocalStore", "MemoryStore", "Store", "is_object_url", "open_store"]


def open_store(location: str | os.PathLike[str] | Store, **storage_options: Any) -> Store:
    """A Store for a local path, ``file://`` URL, ``memory://`` (fresh, empty), an object-store URL
    (``s3://bucket/prefix``; also ``gs://``, ``az://`` when their fsspec package is installed) or an existing Store.

    Object stores take their options from the environment (for S3: ``LUOPAN_S3_ENDPOINT_URL`` or
    ``AWS_ENDPOINT_URL``, the usual AWS credentials) and from ``storage_options``, passed to the fsspec filesystem
    (``endpoint_url``, ``key``, ``secret``, ``client_kwargs`` …); local paths and memory:// take none.
    """
    if isinstance(location, Store):
        return location
    loc = os.fspath(location)
    if storage_options and not is_object_url(loc):
        raise InvalidNameError(f"storage options {sorted(storage_options)} apply to object-store URLs only, not {loc!r}")
    if "://" not in loc:
        return LocalStore(loc)
    scheme, rest = loc.split("://", 1)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "memory":
        return MemoryStore()
    if scheme.lower() in OBJECT_STORE_SCHEMES:
        return FsspecStore(loc, **storage_options)
    raise InvalidNameError(
        f"unsupported repository URL scheme {scheme!r} in {loc!r}: use a local path, file://, memory:// or an "
        f"object store ({', '.join(s + '://' for s in OBJECT_STORE_SCHEMES)}; s3 needs pip install \"luopan[s3]\")"
    )

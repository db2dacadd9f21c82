"""Portable patches (docs/format.md §13): ship the change from one checkpoint to another as one signed file, and
apply it on a device that has only the base as a safetensors file — no repository needed.

    import luopan.patch
    luopan.patch.create(repo, "run-a", 100, 200, "update.lpatch", subtree="model", sign_key="keys/luopan.key")
    luopan.patch.apply("update.lpatch", "base.safetensors", "new.safetensors", trusted_keys="trusted/")
    luopan.patch.fingerprint_file("base.safetensors")   # the content fingerprint a patch checks its base against
"""

from __future__ import annotations

import os

from ..errors import CorruptSafetensorsError
from ..format.config import DEFAULT_CHUNK_SIZE
from .apply import apply
from .basefile import hash_file
from .create import create
from .files import open_regular
from .header import FORMAT_VERSION



def fingerprint_file(path: str | os.PathLike[str], chunk_size: int = DEFAULT_CHUNK_SIZE) -> str:
    """The content fingerprint (``blake3:<hex>``) of a safetensors file's tensors at ``chunk_size`` (docs/format.md
    §13.3): what ``patch apply`` compares with the patch's base fingerprint."""
    where = os.fspath(path)
    fd = open_regular(where, CorruptSafetensorsError)
    try:
        return hash_file(fd, where, chunk_size).fingerprint
    finally:
        os.close(fd)


__all__ = ["FORMAT_VERSION", "apply", "create", "fingerprint_file"]

"""Portable patches (docs/format.md §13): ship the change from one checkpoint to another as one signed file, and
apply it on a device that has only the base as a safetensors file — no repository needed.

    import luopan.patch
    luopan.patch.create(repo, "run-a", 100, 200, "update.lpatch", subtree="model", sign_key="keys/luopan.key")
    luopan.patch.apply("update.lpatch", "base.safetensors", "new.safetensors", trusted_keys="trusted/")
    luopan.patch.fingerprint_file("base.safetensors")   # the content fingerprint a patch checks its base against
    luopan.patch.read_header("update.lpatch", trusted_keys="trusted/")  # what it makes, before applying it

``apply``, ``read_header`` and ``fingerprint_file`` work on files alone and import no repository (a device that only
applies patches loads a few small modules); ``create``, which reads a repository, is loaded on first use.
"""

from __future__ import annotations

import os
from typing import Any

from .._lazy import lazy_names
from ..errors import CorruptSafetensorsError
from ..format.config import DEFAULT_CHUNK_SIZE
from ..signing import TrustedKeys
from .apply import apply
from .basefile import hash_file
from .files import open_regular
from .header import FORMAT_VERSION
from .prepare import open_checked


def read_header(path: str | os.PathLike[str], *, trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None,
                require_signature: bool | None = None) -> dict[str, Any]:
    """What the patch at ``path`` makes, checked as ``apply`` checks it before reading a base (docs/format.md
    §13.4): the prefix, the signature (with ``trusted_keys`` or ``require_signature``, as in ``apply``), the
    header and the file's length; CorruptPatchError, UnsupportedFormatError or a SignatureError otherwise. No base
    is read, nothing is written.

    Returns base_fingerprint, base_tensors, base_bytes, base_source, target_fingerprint, target_tensors,
    target_bytes, run, step (the target's), chunk_size, subtree, carried_chunks, body_bytes, patch_bytes, created,
    signed (whether it carries a signature) and signed_by (the trusted key that signed it; None when no signature
    was checked)."""
    pf, h, signed_by = open_checked(path, trusted_keys, require_signature)
    try:
        return {"base_fingerprint": h.base["fingerprint"], "base_tensors": h.base["tensors"],
                "base_bytes": h.base["bytes"], "base_source": h.base["source"],
                "target_fingerprint": h.target["fingerprint"], "target_tensors": h.target["tensors"],
                "target_bytes": h.target["bytes"], "run": h.target["run"], "step": h.target["step"],
                "chunk_size": h.chunk_size, "subtree": h.subtree, "carried_chunks": len(h.blobs),
                "body_bytes": h.body_bytes, "patch_bytes": pf.size, "created": h.created,
                "signed": pf.signature is not None, "signed_by": signed_by}
    finally:
        pf.close()


def fingerprint_file(path: str | os.PathLike[str], chunk_size: int = DEFAULT_CHUNK_SIZE) -> str:
    """The content fingerprint (``blake3:<hex>``) of a safetensors file's tensors at ``chunk_size`` (docs/format.md
    §13.3): what ``patch apply`` compares with the patch's base fingerprint."""
    where = os.fspath(path)
    fd = open_regular(where, CorruptSafetensorsError)
    try:
        return hash_file(fd, where, chunk_size).fingerprint
    finally:
        os.close(fd)


# ``luopan.patch.create`` on first use (it imports the repository; luopan.patch.creating)
__getattr__, __dir__ = lazy_names(__name__, {"create": ".creating"})

__all__ = ["FORMAT_VERSION", "apply", "create", "fingerprint_file", "read_header"]

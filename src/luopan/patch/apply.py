"""``luopan.patch.apply``: a patch and the base it was made for make the target, as a safetensors file (no
repository needed) or as a checkpoint of a repository (docs/format.md §13.4).

The output file is streamed (``direct.write_file``): each worker holds one chunk at a time, read from the patch or,
in the single pass that hashes the base, from the base, verified, and written at its place in a temporary file that
is renamed over the output only once everything is written and synced.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._files import check_output_path
from ..errors import UsageError
from ..signing import TrustedKeys
from ..units import format_bytes
from .commit import check_memory, commit
from .direct import write_file
from .header import Header
from .prepare import prepare
from .stfile import header_bytes


def apply(
    patch_path: str | os.PathLike[str],
    base_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    *,
    trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None,
    require_signature: bool | None = None,
    repo: Any = None,
    run: str | None = None,
    step: int | None = None,
    expect_target: str | None = None,
    max_output_bytes: int | None = None,
    progress: Callable[[int], Any] | None = None,
    on_total: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Apply the patch at ``patch_path`` to the safetensors file ``base_path`` and write the target to ``out_path``
    (a safetensors file, the same bytes ``luopan export`` writes for the target); or, with ``repo`` (a luopan.Repo
    or location) instead of ``out_path``, commit it as checkpoint ``step`` of ``run`` (the patch's target run and
    step by default).

    Before anything is written: the signature is checked when ``trusted_keys`` (a directory, a TrustedKeys, or
    $LUOPAN_TRUSTED_KEYS) are given or ``require_signature`` is true (UnsignedError, UntrustedKeyError,
    SignatureError); the header is checked (CorruptPatchError, UnsupportedFormatError); the base's content
    fingerprint must be the patch's (BaseMismatchError naming both). With ``expect_target`` (a content fingerprint,
    ``blake3:<hex>``) the patch's target must be that content (StateMismatchError, before the base is read). With
    ``max_output_bytes`` an output file larger than that is refused (UsageError, before the base is read). Every
    chunk is verified as it is written, the output appears atomically, and an existing output file is untouched by
    any failure. Writing a file, memory stays within a fixed budget plus one chunk, whatever the model's size; with
    ``repo`` the whole target is held in memory (it is committed with ``repo.save``), so a target larger than the
    memory available is refused (UsageError) before anything is read or allocated. ``require_signature=False``
    accepts an unsigned patch even when trusted keys are set. ``progress(n)`` gets bytes hashed and written;
    ``on_total(n)`` their total.

    Returns path (or run and step), bytes, tensors, chunks, bytes_from_base, bytes_from_patch, base_fingerprint,
    target_fingerprint, signed (whether it carries a signature), signed_by (the trusted key that signed it; None when
    no signature was checked).
    """
    if (out_path is None) == (repo is None):
        raise UsageError("give exactly one destination: an output file (-o FILE) or a repository (-r REPO)")
    if (run is not None or step is not None) and repo is None:
        raise UsageError("run and step name a checkpoint to commit: they need a repository (-r REPO)")
    if max_output_bytes is not None and (type(max_output_bytes) is not int or max_output_bytes < 1):
        raise UsageError(f"max_output_bytes must be a positive int, got {max_output_bytes!r}")
    if max_output_bytes is not None and out_path is None:
        raise UsageError("max_output_bytes limits the output file: it needs out_path (-o FILE)")
    if out_path is not None:
        check_output_path(out_path)  # an output that cannot be written is refused before the base is read
    else:  # the repository is imported only here: applying to a file needs none of it
        from ..repo import Repo
        from ..repo import open as open_repo

        repo = repo if isinstance(repo, Repo) else open_repo(repo, create=False, replicate=False)

    def check(header: Header) -> None:
        if repo is not None:
            check_memory(header)
        elif max_output_bytes is not None:
            size = _output_size(header)
            if size > max_output_bytes:
                raise UsageError(f"{os.fspath(patch_path)} makes a {format_bytes(size)} file ({size} bytes), over the "
                                 f"limit of {format_bytes(max_output_bytes)}; nothing was written")

    with prepare(patch_path, base_path, trusted_keys=trusted_keys, require_signature=require_signature,
                 expect_target=expect_target, check=check, progress=progress, on_total=on_total,
                 hash_base=repo is not None) as prep:  # a file's target is written as the base is hashed
        target_bytes = prep.header.target["bytes"]
        if repo is not None:
            done = commit(prep, repo, run, step, progress)
        else:
            done = {"path": os.fspath(out_path), "bytes": write_file(prep, out_path, _head(prep.header), progress)}
        from_patch = sum(c.size for c in prep.chunks if c.blob is not None)
        return {**done, "tensors": len(prep.header.tensors), "chunks": len(prep.chunks),
                "bytes_from_base": target_bytes - from_patch, "bytes_from_patch": from_patch,
                "base_fingerprint": prep.base.fingerprint, "target_fingerprint": prep.header.target["fingerprint"],
                "signed": prep.patch.signature is not None, "signed_by": prep.signed_by}


def _head(header: Header) -> bytes:
    return header_bytes(header.metadata, [(t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors])


def _output_size(header: Header) -> int:
    return len(_head(header)) + header.target["bytes"]

"""``luopan.patch.create``: a patch from one checkpoint (or a plain safetensors base) to another (docs/format.md §13).
Loaded on first use of ``luopan.patch.create``: applying a patch imports no repository.

The patch carries the target's tensor list and only the chunks the base lacks. It is written atomically: the blobs go
to an anonymous temporary file first (the header that names their offsets precedes them), then the patch is
assembled next to its final name and renamed into place.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import zstandard

from .._files import check_output_path
from ..errors import CorruptSafetensorsError, UsageError
from ..format.manifest import Manifest
from ..format.names import check_run, check_step
from ..repo import Repo
from ..repo import open as open_repo
from ..repository.chunkio import PackSizes
from ..signing import SigningKey, load_signing_key
from .basefile import hash_file
from .container import MAX_HEADER_BYTES, PREFIX, prefix_bytes, signature_bytes
from .fingerprint import content_fingerprint
from .files import AtomicOutput, open_regular, read_exact
from .header import Blob, TensorSpec, build_header
from .prepare import WINDOW_LOG
from .sources import StoredTensor, checkpoint_tensors, export_metadata, tensor_chunks

ZSTD_LEVEL = 3  # blobs are compressed only when that saves bytes (trained fp32 weights shrink ~8% at level 3)
COPY_PIECE = 8 << 20


def create(
    repo: Any,
    run: str,
    from_step: int | None,
    to_step: int,
    out_path: str | os.PathLike[str],
    *,
    subtree: str | None = None,
    sign_key: SigningKey | str | os.PathLike[str] | None = None,
    from_file: str | os.PathLike[str] | None = None,
    progress: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Write a patch that turns the base — checkpoint ``from_step`` of ``run``, or the safetensors file
    ``from_file`` — into checkpoint ``to_step`` (its tensors under ``subtree``, e.g. ``"model"``, as ``repo.export``
    writes them) at ``out_path``.

    ``repo`` is a luopan.Repo or a repository location. Exactly one of ``from_step`` and ``from_file`` is given. A
    base file is cut into chunks at the repository's chunk size, so its unchanged tensors match the target's chunks
    by hash and are not carried. ``sign_key`` (a SigningKey or a ``.key`` file) signs the header. Returns a summary:
    path, bytes, tensors, chunks, carried_chunks, carried_bytes (raw), changed_tensors, base_fingerprint,
    target_fingerprint, signed_by.
    """
    if (from_step is None) == (from_file is None):
        raise UsageError("give exactly one base: a step of the run (--from STEP) or a safetensors file (--from-file)")
    check_run(run)
    to_step = check_step(to_step)
    r = _open(repo)
    key = load_signing_key(sign_key) if sign_key is not None and not isinstance(sign_key, SigningKey) else sign_key
    chunk_size = r.config.chunk_size
    target_m = r.manifest(run, to_step)
    targets = checkpoint_tensors(target_m, subtree, chunk_size)
    prefix = _prefix(target_m, subtree)
    sizes = PackSizes(r.store)
    if from_file is not None:
        base_fp, base_hashes, base_source, base_counts = _file_base(from_file, chunk_size)
    else:
        base_m = r.manifest(run, check_step(from_step))
        based = checkpoint_tensors(base_m, subtree, chunk_size)
        hashes = [_hashes(r, base_m, t, chunk_size, sizes) for t in based]
        base_fp = content_fingerprint(chunk_size, ((t.name, t.dtype, t.shape, h)
                                                   for t, h in zip(based, hashes, strict=True)))
        base_hashes = {h for hs in hashes for h in hs}
        base_source = f"{run}@{base_m.step}" + (f":{subtree}" if subtree else "")
        base_counts = (len(based), sum(t.nbytes for t in based))
    check_output_path(out_path)  # the output's directory exists and it is not a directory, before the work

    specs: list[TensorSpec] = []
    blobs: list[Blob] = []
    carried: set[str] = set()
    changed = 0
    # the window set explicitly (level 3's own): every frame decodes within the reader's MAX_WINDOW
    cctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        ZSTD_LEVEL, window_log=WINDOW_LOG))
    with tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(out_path))) as body:
        offset = 0
        for t in targets:
            chunks = []
            for h, size, data in tensor_chunks(r.store, target_m, t, chunk_size, sizes,
                                               lambda h: h not in base_hashes and h not in carried):
                chunks.append((h, size))
                if data is not None:
                    packed = cctx.compress(data)
                    codec, stored = ("zstd", packed) if len(packed) < size else ("none", data)
                    body.write(stored)
                    blobs.append(Blob(h, offset, len(stored), size, codec))
                    carried.add(h)
                    offset += len(stored)
                if progress is not None:
                    progress(size)
            changed += any(h in carried for h, _s in chunks)
            specs.append(TensorSpec(t.name, t.dtype, t.shape, t.nbytes, tuple(chunks)))
        body.flush()
        target_fp = content_fingerprint(chunk_size, ((s.name, s.dtype, s.shape, [h for h, _ in s.chunks])
                                                     for s in specs))
        header = build_header(
            chunk_size=chunk_size, tensors=specs, blobs=blobs,
            base={"bytes": base_counts[1], "fingerprint": base_fp, "source": base_source[:4096],
                  "tensors": base_counts[0]},
            target={"bytes": sum(s.nbytes for s in specs), "fingerprint": target_fp, "run": run,
                    "step": target_m.step, "tensors": len(specs)},
            metadata=export_metadata(target_m), subtree=prefix,
            created=datetime.now(timezone.utc).isoformat())
        if len(header) > MAX_HEADER_BYTES:
            raise UsageError(f"the patch's header would be {len(header)} bytes, over the {MAX_HEADER_BYTES}-byte "
                             "limit readers enforce: too many chunks (a repository with a larger chunk_size, or a "
                             "patch of a --subtree, lists fewer); nothing was written")
        sig = signature_bytes(key.sign(header) if key is not None else None)
        total = PREFIX.size + len(header) + len(sig) + offset
        with AtomicOutput(out_path, total) as out:
            out.write(prefix_bytes(header, sig) + header + sig, 0)
            _copy(body.fileno(), offset, out, total - offset)
    return {
        "path": os.fspath(out_path), "bytes": total, "tensors": len(specs),
        "chunks": sum(len(s.chunks) for s in specs), "carried_chunks": len(blobs),
        "carried_bytes": sum(b.size for b in blobs), "changed_tensors": changed,
        "base_fingerprint": base_fp, "target_fingerprint": target_fp,
        "signed_by": key.key_id if key is not None else None,
    }


def _prefix(m: Manifest, subtree: str | None) -> str | None:
    """The key path the exported names are relative to: ``subtree`` without a trailing '/', or its parent when it
    names one tensor (exported under its last key)."""
    if subtree is None:
        return None
    if any(e["path"] == subtree for e in m.entries):
        return subtree.rsplit("/", 1)[0] if "/" in subtree else None
    return subtree.rstrip("/") or None


def _open(repo: Any) -> Repo:
    """A Repo as given, or the existing repository at a location (never created here)."""
    return repo if isinstance(repo, Repo) else open_repo(repo, create=False, replicate=False)


def _hashes(r: Repo, m: Manifest, t: StoredTensor, chunk_size: int, sizes: PackSizes) -> list[str]:
    if t.hashes is not None:
        return list(t.hashes)
    return [h for h, _size, _data in tensor_chunks(r.store, m, t, chunk_size, sizes, lambda h: False)]


def _file_base(path: str | os.PathLike[str], chunk_size: int) -> tuple[str, set[str], str, tuple[int, int]]:
    where = os.fspath(path)
    fd = open_regular(where, CorruptSafetensorsError)
    try:
        hashed = hash_file(fd, where, chunk_size)
    finally:
        os.close(fd)
    return hashed.fingerprint, set(hashed.where), os.path.basename(where), (len(hashed.tensors), hashed.nbytes)


def _copy(src: int, length: int, out: AtomicOutput, at: int) -> None:
    buf = memoryview(bytearray(min(COPY_PIECE, max(length, 1))))
    done = 0
    while done < length:
        n = read_exact(src, buf[: min(len(buf), length - done)], done)
        if n == 0:
            raise OSError(5, "the temporary body file is shorter than what was written to it")
        out.write(buf[:n], at + done)
        done += n

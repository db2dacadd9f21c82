"""Export: materialise a checkpoint, or one subtree of it, as a single safetensors file.

This is the reference article's "merge base + delta chain into a full model" without any chain: a manifest already
lists every chunk. The file is streamed chunk by chunk (each verified as read), so exporting needs memory for a few
chunks, not for the whole model, and it is written atomically (temp file, fsync, rename).
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._files import sync_placed, write_error
from ..errors import CheckpointNotFoundError, LuopanError, UnsupportedValueError
from ..format.manifest import Manifest, Row, rows_of
from ..store.base import Store
from ..repository.parallel import WORKERS, ordered_map
from ..repository.chunkio import ChunkRef, read_chunk, read_chunks
from .deltaplan import zero_chunk
from ..format.dtypes import SAFETENSORS_DTYPES
from .._files import check_output_path
from .chunkplan import PendingDelta, PendingXor, check_rows, chunk_refs, delta_jobs

def select_entries(m: Manifest, subtree: str | None) -> list[tuple[str, int]]:
    """(name in the export, entry index) for every tensor entry at or below ``subtree`` (all when None)."""
    out = []
    for i, e in enumerate(m.entries):
        path = e["path"]
        if subtree is None:
            out.append((path, i))
        elif path == subtree:
            out.append((path.rsplit("/", 1)[-1], i))
        elif path.startswith(subtree.rstrip("/") + "/"):
            out.append((path[len(subtree.rstrip("/")) + 1 :], i))
    if not out:
        tops = sorted({e["path"].split("/", 1)[0] for e in m.entries})
        where = f"under {subtree!r}" if subtree else "at all"
        raise CheckpointNotFoundError(
            f"run {m.run!r} step {m.step} has no tensors {where}; top-level keys with tensors: {', '.join(tops)}"
        )
    return out


def export_safetensors(
    store: Store,
    m: Manifest,
    out_path: str | os.PathLike[str],
    subtree: str | None = None,
    progress: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """Write the selected tensors of manifest ``m`` to ``out_path`` as safetensors. Returns a summary.

    OutputPathError (nothing written) when ``out_path`` is a directory or its directory does not exist."""
    out_path = check_output_path(out_path)
    selected = select_entries(m, subtree)
    sizes = check_rows(store, m, sorted({m.entries[i].get("alias_of", i) for _name, i in selected}))
    deltas: dict[int, PendingDelta] = {}
    header: dict[str, Any] = {"__metadata__": {
        "format": "pt", "luopan.run": m.run, "luopan.step": str(m.step), "luopan.fingerprint": m.doc["fingerprint"],
    }}
    refs: list[tuple[ChunkRef, int, PendingDelta | PendingXor | None]] = []  # (chunk, its offset in the entry, row delta)
    offset = 0
    for name, i in selected:
        e = m.entries[i]
        if name == "__metadata__":
            raise UnsupportedValueError(
                f"entry {e['path']!r} would be named __metadata__, which safetensors reserves; export a subtree "
                "that does not contain it (--subtree)"
            )
        code = SAFETENSORS_DTYPES.get(e["dtype"])
        if code is None:
            raise UnsupportedValueError(
                f"entry {e['path']!r} has dtype {e['dtype']}, which safetensors cannot store; export a subtree "
                "without it (--subtree) or convert it in a copy of the state"
            )
        header[name] = {"dtype": code, "shape": e["shape"], "data_offsets": [offset, offset + e["nbytes"]]}
        offset += e["nbytes"]
        source = e.get("alias_of", i)  # tied tensors are written once per name (safetensors shares nothing)
        delta = deltas.get(source)
        if delta is None and ("delta" in m.entries[source] or "xor" in m.entries[source]):
            delta, jobs = delta_jobs(m, source, store, sizes)  # a (small) row delta first, then patch chunks
            read_chunks(store, jobs, sizes=sizes)
            deltas[source] = delta
        refs += [(ref, pos, delta) for pos, ref in chunk_refs(m, source)]
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as safetensors writes it

    tmp = f"{out_path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"

    def fetch(job: tuple[ChunkRef, int, PendingDelta | PendingXor | None]) -> bytearray:
        ref, pos, delta = job
        sizes.check(ref)  # before the buffer is sized by the row
        buf = bytearray(ref.size)
        read_chunk(store, ref, memoryview(buf), sizes)
        if delta is not None:
            delta.apply(memoryview(buf), pos)
        return buf

    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise _output_error(exc, out_path) from None
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            with ThreadPoolExecutor(WORKERS, "luopan-export") as pool:
                for buf in ordered_map(pool, fetch, refs, window=2 * WORKERS):
                    f.write(buf)
                    if progress is not None:
                        progress(len(buf))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, LuopanError):
            raise _output_error(exc, out_path) from None
        raise
    sync_placed(out_path)
    return {"path": out_path, "tensors": len(selected), "bytes": 8 + len(head) + offset}


def _output_error(exc: OSError, path: str) -> BaseException:
    return write_error(exc, path, "nothing was written")


def diff_manifests(a: Manifest, b: Manifest) -> dict[str, Any]:
    """Entries added, removed and changed from ``a`` to ``b``, with the bytes of chunks that differ."""
    def chunks(m: Manifest, e: dict[str, Any]) -> list[tuple[Any, int]]:
        """(content key, size) of the entry's stored parts: chunks, then any row delta's index and values. A chunk
        of an XOR delta is its base chunk where the XOR is all zeros, else the pair (base, XOR)."""
        src = m.entries[e["alias_of"]] if "alias_of" in e else e
        if "xor" not in src:
            return [(r.hash, r.size) for r in rows_of(src)]
        return [(b.hash if x.hash == zero_chunk(x.size)[0] else (b.hash, x.hash), b.size)
                for b, x in zip(map(Row._make, src["chunks"]), map(Row._make, src["xor"]["chunks"]))]

    ea = {e["path"]: e for e in a.entries}
    eb = {e["path"]: e for e in b.entries}
    changed = []
    for path, e in eb.items():
        old = ea.get(path)
        if old is None:
            continue
        ca, cb = chunks(a, old), chunks(b, e)
        layout_changed = (old["dtype"], old["shape"]) != (e["dtype"], e["shape"])
        if layout_changed or ca != cb:
            differs = [layout_changed or k >= len(ca) or ca[k][0] != h for k, (h, _size) in enumerate(cb)]
            changed.append({"path": path, "dtype": e["dtype"], "shape": e["shape"], "nbytes": e["nbytes"],
                            "changed_chunks": sum(differs),
                            "changed_bytes": sum(size for d, (_h, size) in zip(differs, cb) if d),
                            "was": {"dtype": old["dtype"], "shape": old["shape"]} if layout_changed else None,
                            "tied_to": b.entries[e["alias_of"]]["path"] if "alias_of" in e else None})
    added = [{"path": p, "dtype": e["dtype"], "shape": e["shape"], "nbytes": e["nbytes"]}
             for p, e in eb.items() if p not in ea]
    removed = [{"path": p, "dtype": e["dtype"], "shape": e["shape"], "nbytes": e["nbytes"]}
               for p, e in ea.items() if p not in eb]
    return {
        "run": b.run, "from_step": a.step, "to_step": b.step,
        "changed": changed, "added": added, "removed": removed,
        "unchanged": sum(1 for p in eb if p in ea) - len(changed),
        # a tied entry shares its source's chunks: count them once, unless only the tied entry changed
        "changed_bytes": sum(c["changed_bytes"] for c in changed
                             if c["tied_to"] is None or c["tied_to"] not in {x["path"] for x in changed})
        + sum(eb[x["path"]]["nbytes"] for x in added if "alias_of" not in eb[x["path"]]),
        "metrics": {"from": a.metrics, "to": b.metrics},
        "same_structure": a.doc["fingerprint"] == b.doc["fingerprint"],
    }

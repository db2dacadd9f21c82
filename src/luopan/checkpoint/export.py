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
from ..repository.chunkio import read_chunk, read_chunks
from .deltaplan import zero_chunk
from ..format.dtypes import SAFETENSORS_DTYPES
from .._files import check_output_path
from ..tree import itemsize, new_array
from .chunkplan import PendingDelta, check_rows, chunk_refs, delta_jobs, entry_jobs
from .distributed.dcpview import layouts
from .distributed.ranks import Sharded, byte_span, region

def select_entries(m: Manifest, subtree: str | None,
                   sharded: dict[str, Sharded] | None = None) -> list[tuple[str, Any]]:
    """(name in the export, entry index) for every tensor entry at or below ``subtree`` (all when None). With
    ``sharded`` (layouts by path), the entries that are chunks of a sharded tensor give way to one (name, its
    Sharded) at the place of its first chunk."""
    owner = {c.entry: s for s in (sharded or {}).values() for c in s.chunks}
    items: list[tuple[str, Any]] = []
    for i, e in enumerate(m.entries):
        s = owner.get(i)
        if s is None:
            items.append((e["path"], i))
        elif min(c.entry for c in s.chunks) == i:
            items.append((s.path, s))
    out = []
    for path, item in items:
        if subtree is None:
            out.append((path, item))
        elif path == subtree:
            out.append((path.rsplit("/", 1)[-1], item))
        elif path.startswith(subtree.rstrip("/") + "/"):
            out.append((path[len(subtree.rstrip("/")) + 1 :], item))
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
    *,
    pieces: bool = False,
) -> dict[str, Any]:
    """Write the selected tensors of manifest ``m`` to ``out_path`` as safetensors, sharded tensors whole unless
    ``pieces``. Returns a summary.

    OutputPathError (nothing written) when ``out_path`` is a directory or its directory does not exist."""
    out_path = check_output_path(out_path)
    selected = select_entries(m, subtree, None if pieces else layouts(m).sharded)
    used = [c.entry for _n, s in selected if isinstance(s, Sharded) for c in s.chunks]
    used += [i for _n, i in selected if not isinstance(i, Sharded)]
    sizes = check_rows(store, m, sorted({m.entries[i].get("alias_of", i) for i in used}))
    deltas: dict[int, PendingDelta] = {}
    header: dict[str, Any] = {"__metadata__": {
        "format": "pt", "luopan.run": m.run, "luopan.step": str(m.step), "luopan.fingerprint": m.doc["fingerprint"],
    }}
    refs: list[Any] = []  # (chunk, its offset in the entry, row delta), or a callable giving a whole tensor's bytes

    def add_entry(source: int) -> None:
        delta = deltas.get(source)
        if delta is None and ("delta" in m.entries[source] or "xor" in m.entries[source]):
            delta, jobs = delta_jobs(m, source, store, sizes)  # a (small) row delta first, then patch chunks
            read_chunks(store, jobs, sizes=sizes)
            deltas[source] = delta
        refs.extend((ref, pos, delta) for pos, ref in chunk_refs(m, source))

    offset = 0
    for name, item in selected:
        if isinstance(item, Sharded):
            path, dtype, shape = item.path, item.dtype, list(item.size)
            nbytes = sum(m.entries[c.entry]["nbytes"] for c in item.chunks)  # they tile it exactly (checked)
        else:
            e = m.entries[item]
            path, dtype, shape, nbytes = e["path"], e["dtype"], e["shape"], e["nbytes"]
        if name == "__metadata__":
            raise UnsupportedValueError(
                f"entry {path!r} would be named __metadata__, which safetensors reserves; export a subtree "
                "that does not contain it (--subtree)"
            )
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise UnsupportedValueError(
                f"entry {path!r} has dtype {dtype}, which safetensors cannot store; export a subtree "
                "without it (--subtree) or convert it in a copy of the state"
            )
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if not isinstance(item, Sharded):
            add_entry(m.entries[item].get("alias_of", item))  # tied tensors are written once per name
            continue
        width = itemsize(item.kind, item.dtype) or 1
        spans = [(byte_span(c, item.size, width), c) for c in item.chunks]
        if all(span is not None for span, _c in spans):  # runs of rows: each shard's chunks in turn, streamed
            for _span, c in sorted(spans, key=lambda sc: sc[0]):
                add_entry(c.entry)
        else:
            refs.append(_assembler(store, m, item, sizes))
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as safetensors writes it

    tmp = f"{out_path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"

    def fetch(job: Any) -> Any:
        if callable(job):
            return job()
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


def _assembler(store: Store, m: Manifest, s: Sharded, sizes: Any) -> Callable[[], memoryview]:
    """The bytes of sharded tensor ``s`` whole, read when called: its shards are not runs of rows, so it is put
    together in memory (each chunk verified as read)."""
    def build() -> memoryview:
        whole, dest = new_array(s.kind, s.dtype, list(s.size))
        jobs, parts = [], []
        for c in s.chunks:
            part, view = new_array(s.kind, s.dtype, list(c.sizes))
            jobs += entry_jobs(store, m, c.entry, view, sizes)
            parts.append((region(c), part))
        read_chunks(store, jobs, sizes=sizes)
        for where, part in parts:
            whole[where] = part
        return dest

    return build


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

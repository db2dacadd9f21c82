"""``patch apply -r REPO``: the target of a checked patch committed as a checkpoint instead of written to a file.
The tensors are assembled in memory (each chunk verified as it lands) and saved with ``repo.save``, so the
repository deduplicates them against what it holds; nothing is committed unless every chunk verified."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedValueError, UsageError
from ..format.names import check_run, check_step
from ..units import format_bytes
from .files import available_memory
from .header import Header
from .prepare import Chunk, Prepared

if TYPE_CHECKING:  # pragma: no cover  (annotations only: applying to a file imports no repository)
    from ..repo import Repo


def check_memory(header: Header) -> None:
    """UsageError when the target does not fit in the memory available now (``apply -r`` holds all of it): refused
    before the base is read or anything is allocated. No check where the available memory cannot be read."""
    need = header.target["bytes"]
    avail = available_memory()
    if avail is not None and need > avail:
        raise UsageError(f"committing this patch into a repository holds its whole target in memory: "
                         f"{format_bytes(need)}, and {format_bytes(avail)} is available; nothing was written. Write "
                         "it to a safetensors file instead (-o FILE, memory stays small) and save that")


def commit(prep: Prepared, r: Repo, run: str | None, step: int | None,
           progress: Callable[[int], Any] | None) -> dict[str, Any]:
    """Save the target as checkpoint ``step`` of ``run`` (the patch's target by default), its tensors nested by
    their key paths under the patch's subtree. Returns run, step and the checkpoint's new_bytes."""
    from ..tree import new_array  # NumPy (and torch), only to commit into a repository

    header = prep.header
    run = check_run(run if run is not None else header.target["run"])
    step = check_step(step if step is not None else header.target["step"])
    kind = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    views: list[memoryview] = []
    tensors: dict[str, Any] = {}
    for t in header.tensors:
        if kind == "numpy" and t.dtype not in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                                               "uint64", "uint32", "uint16", "uint8", "bool", "complex64"):
            raise UnsupportedValueError(f"tensor {t.name!r} is {t.dtype}, which NumPy cannot hold: install torch to "
                                        "commit this patch into a repository")
        value, view = new_array(kind, t.dtype, list(t.shape))
        tensors[t.name] = value
        views.append(view)
    # each chunk's place, by its offset in the target's data (a chunk lies in one tensor; empty ones have none)
    dest: dict[int, memoryview] = {}
    offset = 0
    for t, view in zip(header.tensors, views, strict=True):
        for _hash, size in t.chunks:
            dest[offset] = view[:size]
            view = view[size:]
            offset += size

    def one(c: Chunk) -> None:
        prep.read(c, dest[c.offset])
        if progress is not None:
            progress(c.size)

    prep.each(one)
    state = nest(tensors, header.subtree)
    info = r.save(run, step, state, metadata={"patch": {"base_fingerprint": prep.base.fingerprint,
                                                        "target_fingerprint": header.target["fingerprint"],
                                                        "signed_by": prep.signed_by}})
    return {"run": run, "step": step, "bytes": header.target["bytes"], "new_bytes": info.new_bytes}


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def nest(tensors: dict[str, Any], subtree: str | None) -> dict[str, Any]:
    """The state tree whose key paths are ``<subtree>/<name>`` (RFC 6901 parts, as luopan writes key paths)."""
    root: dict[str, Any] = {}
    for name, value in tensors.items():
        node = root
        parts = [_unescape(p) for p in ((subtree + "/" + name) if subtree else name).split("/")]
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise UnsupportedValueError(f"tensor {name!r} lies below another tensor's key path; it cannot be "
                                            "committed as a state tree")
            node = child
        if parts[-1] in node:
            raise UnsupportedValueError(f"tensor {name!r} is also a key path prefix of other tensors")
        node[parts[-1]] = value
    return root

"""The checkpoint kind (docs/format.md §8): save, load and verify state trees of runs in a repository.

Its public face: ``Checkpoints`` (the kind on one Repository: ``repo.checkpointing``), ``CheckpointInfo``,
``SaveHandle``, ``VerifyReport``, ``Run`` (a run's record, eval logs, pins), ``Shard``, ``DeltaPolicy``, and for
tools that read a checkpoint's chunks themselves (patches) ``select_entries``, ``chunk_refs`` and ``delta_jobs``.
Names load on first use: importing one module of this package does not import the whole kind."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpoints": ".api", "CheckpointInfo": ".info", "SaveHandle": ".info", "VerifyReport": ".info",
    "Run": ".runs.record", "Shard": ".distributed.shards", "DeltaPolicy": ".rowdelta",
    "select_entries": ".export", "chunk_refs": ".read", "delta_jobs": ".read",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # PEP 562
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'luopan.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

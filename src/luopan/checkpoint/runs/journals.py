"""Names of the journals the resume check keeps per run (luopan.checkpoint.runs.resumes): ``metrics-<run>`` and
``resumes-<run>``. Apart so that removing a run (luopan.checkpoint.removal) finds them without importing the check."""

from __future__ import annotations

import blake3

METRICS, RESUMES = "metrics-", "resumes-"


def journal_name(prefix: str, run: str) -> str:
    """``prefix + run``, or, when that is longer than a journal name may be, ``prefix``, the run's first 100
    characters, ``-`` and 16 hex digits of the BLAKE3 of the run name."""
    name = prefix + run
    return name if len(name) <= 128 else f"{prefix}{run[:100]}-{blake3.blake3(run.encode()).hexdigest()[:16]}"


def metrics_journal(run: str) -> str:
    """The name of the journal holding ``run``'s per-step metrics (``CheckpointManager.log``, the resume check)."""
    return journal_name(METRICS, run)

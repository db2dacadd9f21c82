"""What a report compares across runs, read without writing: every step's metrics from a run's metrics journal
(``metrics-<run>``, docs/format.md §16.4: what ``CheckpointManager.log``/``maybe_save`` journal), and the run's
config (luopan.checkpoint.changes.run_config: the record's config, the latest manifest's metadata and the settings
subtrees of its state tree)."""

from __future__ import annotations

import math
from typing import Any

from ..checkpoint import metrics_journal, run_config
from ..errors import LuopanError

# More logged points than this per metric and run are thinned to every k-th (the last and every checkpoint's kept):
# a page of a million-step run stays a page.
MAX_POINTS = 4000


def logged_metrics(repo: Any, run: str) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] of every step the run journaled, ascending, as its latest life logged them: a
    ``resumed_from`` marker drops what an interrupted life logged after the step it resumed from, and a step logged
    several times counts with its last value (§16.4). Only finite numbers; {} when the run has no metrics journal
    (saved with ``repo.save`` alone) or it cannot be read."""
    try:
        journal = repo.journal(metrics_journal(run), read_only=True)
    except (FileNotFoundError, LuopanError, OSError):  # none, not a local repository, or damaged
        return {}
    by_step: dict[int, dict[str, float]] = {}
    try:
        for rec in journal.read(journal.first_seq):
            if not isinstance(rec, dict):
                continue
            resumed = rec.get("resumed_from")
            step = rec.get("step")
            if isinstance(resumed, int) and not isinstance(resumed, bool):
                by_step = {s: m for s, m in by_step.items() if s <= resumed}
            elif isinstance(step, int) and not isinstance(step, bool) and isinstance(rec.get("metrics"), dict):
                by_step.setdefault(step, {}).update(
                    {k: float(v) for k, v in rec["metrics"].items() if isinstance(v, (int, float))
                     and not isinstance(v, bool) and math.isfinite(v)})
    except (LuopanError, OSError):
        pass  # a damaged tail: what was read before it is shown (luopan verify names the damage)
    finally:
        try:
            journal.close()
        except (LuopanError, OSError):
            pass
    out: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(by_step):
        for name, value in by_step[step].items():
            out.setdefault(name, []).append((step, value))
    return out


def thin(points: list[tuple[int, float]], keep: set[int]) -> list[tuple[int, float]]:
    """At most about MAX_POINTS of ``points``: every k-th, the last, and every step in ``keep`` (checkpoints)."""
    if len(points) <= MAX_POINTS:
        return points
    k = -(-len(points) // MAX_POINTS)
    return [p for i, p in enumerate(points) if i % k == 0 or i == len(points) - 1 or p[0] in keep]


def config_of(record: dict[str, Any] | None, manifest: Any) -> dict[str, Any]:
    try:
        return run_config(record, manifest)
    except (LuopanError, ValueError, TypeError):
        return {}

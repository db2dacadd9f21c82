"""The checkpoint kind's catalog: which checkpoints a repository holds, found by the one walk every command uses
(docs/format.md §2).

A checkpoint exists iff its manifest exists: a regular file ``runs/<run>/ckpt/<step:08d>.json`` whose run name is
valid and whose step is in range. Listing (``Repo.runs``/``steps``), gc marking, verify, du, prune and replication
all ask `scan`, and every store lists through its own single walk (``LocalStore`` follows symlinks everywhere), so
they all see the same manifests. Whatever else lies under ``runs/`` that luopan did not write (``runs/a copy/``,
``runs/.git``, a manifest name out of range, a FIFO) is a *stray*: skipped, reported by ``scan(..., strays=True)``,
never fatal and never opened.
"""

from __future__ import annotations

from ..format.names import is_run_name, step_from_manifest_key
from ..repository.kinds import Catalog
from ..store.base import Store, Stray

RUNS = "runs/"
_RUN_FILES = ("record.json",)  # luopan's files directly in a run directory besides ckpt/ (docs/format.md §2)
_RUN_DIRS = ("ckpt", "evals")


def scan(store: Store, run: str | None = None, *, strays: bool = False) -> Catalog:
    """The committed checkpoints of the repository (or of one ``run``, whose name the caller has checked). With
    ``strays``, also everything under ``runs/`` (or the run's directory) that is not luopan's."""
    prefix = RUNS if run is None else f"{RUNS}{run}/"
    cat = Catalog()
    bad_runs: dict[str, Stray] = {}
    if strays:  # one walk for the keys and what it passed over
        keys, found = store.list_with_strays(prefix)
    else:
        keys, found = list(store.list(prefix if run is None else f"{prefix}ckpt/")), []
    for key in keys:
        parts = key.split("/")
        name = parts[1] if len(parts) > 1 else ""
        if len(parts) < 3:
            if strays:
                cat.strays.append(Stray(key, "a file directly under runs/ (runs are directories)"))
            continue
        if not is_run_name(name):
            if strays and name not in bad_runs:
                bad_runs[name] = Stray(f"{RUNS}{name}/", "not a valid run name (1-128 ASCII letters, digits, '.', "
                                                         "'_', '-', starting with a letter or digit)")
            if strays and len(parts) == 4 and parts[2] == "ckpt" and step_from_manifest_key(key) is not None:
                cat.shadows.append(key)
            continue
        if parts[2] == "ckpt":
            step = step_from_manifest_key(key) if len(parts) == 4 else None
            if step is not None:
                cat.steps.setdefault(name, []).append(step)
            elif strays:
                cat.strays.append(Stray(key, "not a manifest name (runs/<run>/ckpt/<step:08d>.json, step < 10^15)"))
        elif strays and not (len(parts) == 3 and parts[2] in _RUN_FILES) and parts[2] not in _RUN_DIRS:
            cat.strays.append(Stray(key, "not a file luopan writes in a run directory"))
    for steps in cat.steps.values():
        steps.sort()
    if strays:
        cat.strays.extend(bad_runs.values())
        cat.strays.extend(found)
        cat.strays.sort(key=lambda s: s.key)
    return cat

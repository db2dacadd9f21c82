"""Names that moved off ``luopan.Repo``'s public face (issue 28: at most 20 public methods, each with its real
signature). Each old name still works for one release, with a DeprecationWarning naming its new home."""

from __future__ import annotations

import functools
import inspect
import numbers
import warnings
from collections.abc import Callable
from typing import Any

from .errors import ArgumentTypeError

# old name -> (new spelling shown to the user, how to reach it from a Repo)
MOVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # the core (luopan.repository.core.Repository)
    "lineage": ("repo.repository.lineage(ref)", lambda r: r.repository.lineage),
    "resolve": ("repo.repository.resolve(text)", lambda r: r.repository.resolve),
    "require_format": ("repo.repository.require_format(version)", lambda r: r.repository.require_format),
    "read_manifest": ("repo.repository.read_manifest(kind, series, number)", lambda r: r.repository.read_manifest),
    "learned": ("repo.repository.learned(...)", lambda r: r.repository.learned),
    "chunk_index": ("repo.repository.chunk_index()", lambda r: r.repository.chunk_index),
    "forget_damaged": ("repo.repository.forget_damaged(problems)", lambda r: r.repository.forget_damaged),
    "drain": ("repo.repository.drain()", lambda r: r.repository.drain),
    # tiering (a commit listener of the repository: repo.tier)
    "wait_replicated": ("repo.tier.wait(timeout)", lambda r: lambda *a, **k: r.repository.tiered().wait(*a, **k)),
    "apply_cold_policy": ("repo.tier.apply_cold_policy(now, dry_run=...)",
                          lambda r: lambda *a, **k: r.repository.tiered().apply_cold_policy(*a, **k)),
    "replication_status": ("repo.checkpointing.replication_status(run)",
                           lambda r: r.checkpointing.replication_status),
    # the checkpoint kind (luopan.checkpoint.Checkpoints)
    "sign": ("repo.checkpointing.sign(run, step, key)", lambda r: r.checkpointing.sign),
    "strays": ("repo.checkpointing.strays(run)", lambda r: r.checkpointing.strays),
    "check_inputs": ("repo.checkpointing.check_inputs(inputs)", lambda r: r.checkpointing.check_inputs),
    "store_entries": ("repo.checkpointing.store_entries(tensors)", lambda r: r.checkpointing.store_entries),
    "commit_entries": ("repo.checkpointing.commit_entries(...)", lambda r: r.checkpointing.commit_entries),
    "load_entry": ("repo.checkpointing.load_entry(manifest, index)", lambda r: r.checkpointing.load_entry),
    # the artifact kind
    "artifact_names": ("luopan.artifact.artifact_names(repo)", lambda r: _artifact_names(r)),
}


def _artifact_names(repo: Any) -> Callable[[], list[str]]:
    from .artifact import artifact_names

    return lambda: artifact_names(repo)


def moved(repo: Any, name: str) -> Any:
    """``repo.<name>`` for a name in MOVED (with a DeprecationWarning); AttributeError for any other."""
    entry = MOVED.get(name)
    if entry is None or name.startswith("__"):
        raise AttributeError(f"'Repo' object has no attribute {name!r}")
    spelling, reach = entry
    warnings.warn(f"repo.{name} is deprecated: use {spelling} (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    return reach(repo)


def given(**options: Any) -> dict[str, Any]:
    """The keyword options that differ from their defaults (a collective save refuses the ones it does not take)."""
    defaults = {"overwrite": False, "trust_versions": False}
    return {k: v for k, v in options.items() if v is not defaults.get(k) and v is not None}


def _is_step(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # an int, or a NumPy integer


def step_second(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate ``Repo.<verb>(self, run, step=None, <what>=None, *, ...)``: the step comes second. The old order
    ``repo.<verb>(run, <what>, step)`` — also with ``step=`` as a keyword — is recognised (its second argument is
    not a step) and still works for one release, with a DeprecationWarning. ``inspect.signature`` shows the new
    signature, with its real keywords."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        verb = fn.__name__

        @functools.wraps(fn)
        def wrapper(self: Any, run: Any, *args: Any, **kwargs: Any) -> Any:
            if args and args[0] is not None and not _is_step(args[0]) and what not in kwargs:
                warnings.warn(f"repo.{verb}(run, {what}, step) is deprecated: the step comes second, "
                              f"repo.{verb}(run, step, {what}) or repo.{verb}(run, {what}={what})",
                              DeprecationWarning, stacklevel=2)
                kwargs[what] = args[0]
                args = args[1:]
            bound = signature.bind(self, run, *args, **kwargs)
            if bound.arguments.get(what) is None:
                raise ArgumentTypeError(f"repo.{verb} needs a {what}: repo.{verb}(run, step, {what}) or "
                                 f"repo.{verb}(run, {what}={what})")
            return fn(*bound.args, **bound.kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        return wrapper
    return decorate

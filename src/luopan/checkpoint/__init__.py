"""The checkpoint kind (docs/format.md §8): save, load and verify state trees of runs in a repository.

Its public face: ``Checkpoints`` (the kind on one Repository: ``repo.checkpointing``), ``CHECKPOINTS`` (what the
core knows of the kind), ``CheckpointInfo``, ``SaveHandle``, ``SaveReport``, ``VerifyReport``, ``Run`` (a run's
record, eval logs, pins), ``Shard``, ``DeltaPolicy``; ``check`` / ``Subset`` / ``ALL`` (``luopan check``) and
``remove`` (``luopan rm``); the resume check (``ResumeCheck``, ``RunJournal``, ``list_resumes``) and
``config_json`` for the training integrations; ``metrics_journal`` (the journal of a run's per-step metrics) and
``run_config`` (what a checkpoint says about how it was made) for the report; ``same_version`` (tensor version records) for luopan.dcp; and for
tools that read a checkpoint's chunks themselves (patches, the CheckpointManager) ``select_entries``,
``chunk_refs``, ``delta_jobs`` and ``diff_manifests``. Other packages import only these.
Names load on first use: importing one module of this package does not import the whole kind."""

from __future__ import annotations

from .._lazy import lazy_names

_EXPORTS = {
    "CHECKPOINTS": ".kind", "Checkpoints": ".api", "CheckpointInfo": ".info", "SaveHandle": ".info",
    "VerifyReport": ".info", "SaveReport": ".progress", "Run": ".runs.record", "config_json": ".runs.record",
    "ResumeCheck": ".runs.resumes", "RunJournal": ".runs.resumes", "list_resumes": ".runs.resumes",
    "Shard": ".distributed.shards", "DeltaPolicy": ".rowdelta", "same_version": ".request",
    "check": ".checking", "Subset": ".checking", "ALL": ".checking", "remove": ".removal",
    "diff_manifests": ".export", "select_entries": ".export", "chunk_refs": ".chunkplan", "delta_jobs": ".chunkplan",
    "metrics_journal": ".runs.journals", "run_config": ".changes",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)

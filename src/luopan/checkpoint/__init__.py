"""Checkpoints: save, load and verify state trees in a repository."""

from .export import select_entries
from .read import chunk_refs, delta_jobs

__all__ = ["chunk_refs", "delta_jobs", "select_entries"]

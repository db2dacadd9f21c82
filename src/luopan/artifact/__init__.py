"""Artifacts: versioned, content-addressed files and directories with lineage (datasets, eval outputs, configs)."""

from .api import Artifact, ArtifactVersion

__all__ = ["Artifact", "ArtifactVersion"]

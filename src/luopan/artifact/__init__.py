"""Artifacts: versioned, content-addressed files and directories with lineage (datasets, eval outputs, configs)."""

from .api import Artifact, ArtifactVersion, artifact_names

__all__ = ["Artifact", "ArtifactVersion", "artifact_names"]

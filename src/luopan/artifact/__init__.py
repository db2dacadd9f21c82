"""Artifacts: versioned, content-addressed files and directories with lineage (datasets, eval outputs, configs)."""

from .api import Artifact, ArtifactVersion, artifact_names
from .compare import ArtifactDiff, CheckoutStatus, FileChange
from .kind import ARTIFACTS_KIND

__all__ = ["ARTIFACTS_KIND", "Artifact", "ArtifactDiff", "ArtifactVersion", "CheckoutStatus", "FileChange",
           "artifact_names"]

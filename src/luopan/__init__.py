"""luopan (落盘): atomic, verified, incremental persistence for AI runs.

    import luopan
    repo = luopan.open("ckpts")
    info = repo.save("run-a", step=100, state=state, metrics={"loss": 0.52})
    state = repo.load("run-a")
"""

from . import policies, retention
from .artifact import Artifact, ArtifactVersion
from .checkpoint.info import CheckpointInfo, SaveHandle, VerifyReport
from .repo import Repo, init, open
from .repository.lineage import Lineage
from .checkpoint.rowdelta import DeltaPolicy
from .checkpoint.runrecord import Run
from .checkpoint.shards import Shard
from .repository.tiersetup import ColdPolicy
from .errors import (
    ArgumentTypeError,
    ArtifactNotFoundError,
    BaseMismatchError,
    CheckpointExistsError,
    PinnedError,
    ChannelDownloadError,
    ChannelExpiredError,
    ChannelRollbackError,
    ChannelStateError,
    CorruptChannelIndexError,
    CorruptDownloadError,
    CheckpointNotFoundError,
    CollectiveError,
    CollectiveStorageError,
    CollectiveStorageFullError,
    ConfigConflictError,
    CorruptJournalError,
    CorruptManifestError,
    CorruptPackError,
    CorruptPatchError,
    CorruptSafetensorsError,
    CorruptRepoError,
    GcError,
    InsufficientSpaceError,
    InvalidPathError,
    IntegrityError,
    InvalidNameError,
    JournalBusyError,
    LayoutMismatchError,
    LockedError,
    LuopanError,
    ManifestNameError,
    ManifestNotFoundError,
    MissingDependencyError,
    MissingPackError,
    NotARepositoryError,
    ObjectStoreError,
    ObjectTooLargeError,
    OutputPathError,
    PlanInputError,
    RecordNotFoundError,
    ProbeError,
    ReplicationError,
    RepoExistsError,
    RepoNotFoundError,
    SignatureError,
    SourceChangedError,
    StateMismatchError,
    StorageError,
    StorageFullError,
    UnreadableError,
    UnsignedError,
    UnsupportedFileError,
    UnsupportedFormatError,
    UnsupportedValueError,
    UntrustedKeyError,
    UsageError,
)

__version__ = "0.1.0"


# Modules reached as luopan.<name> on first use (most import optional or heavy packages: torch, peft, transformers,
# faiss, langgraph).
_LAZY = ("torch", "patch", "channel", "signing", "peft", "hf", "dcp", "lightning", "journal", "index", "langgraph",
         "doctor")


def __getattr__(name: str):  # noqa: ANN202 - module attribute hook (PEP 562)
    """``luopan.torch`` (and the other _LAZY modules) on first use: importing luopan must not import torch, nor
    require it to be installed."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'luopan' has no attribute {name!r}")


__all__ = [
    "Artifact",
    "ArtifactNotFoundError",
    "ArtifactVersion",
    "BaseMismatchError",
    "ArgumentTypeError",
    "CheckpointExistsError",
    "PinnedError",
    "ChannelDownloadError",
    "ChannelExpiredError",
    "ChannelRollbackError",
    "ChannelStateError",
    "CorruptChannelIndexError",
    "CorruptDownloadError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ColdPolicy",
    "CollectiveError",
    "CollectiveStorageError",
    "CollectiveStorageFullError",
    "ConfigConflictError",
    "CorruptJournalError",
    "CorruptManifestError",
    "CorruptPackError",
    "CorruptPatchError",
    "CorruptSafetensorsError",
    "CorruptRepoError",
    "DeltaPolicy",
    "GcError",
    "InsufficientSpaceError",
    "InvalidPathError",
    "IntegrityError",
    "InvalidNameError",
    "JournalBusyError",
    "LayoutMismatchError",
    "LockedError",
    "Lineage",
    "LuopanError",
    "ManifestNameError",
    "ManifestNotFoundError",
    "MissingDependencyError",
    "MissingPackError",
    "NotARepositoryError",
    "ObjectStoreError",
    "ObjectTooLargeError",
    "OutputPathError",
    "PlanInputError",
    "RecordNotFoundError",
    "ProbeError",
    "ReplicationError",
    "Repo",
    "RepoExistsError",
    "RepoNotFoundError",
    "Run",
    "SaveHandle",
    "SignatureError",
    "SourceChangedError",
    "Shard",
    "StateMismatchError",
    "StorageError",
    "StorageFullError",
    "UnreadableError",
    "UnsignedError",
    "UnsupportedFileError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
    "UntrustedKeyError",
    "UsageError",
    "VerifyReport",
    "init",
    "open",
    "policies",
    "retention",
]

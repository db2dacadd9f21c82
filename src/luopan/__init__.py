"""luopan (落盘): atomic, verified, incremental persistence for AI runs.

    import luopan
    repo = luopan.open("ckpts")
    info = repo.save("run-a", step=100, state=state, metrics={"loss": 0.52})
    state = repo.load("run-a")
"""

from typing import TYPE_CHECKING

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
    CheckoutConflictError,
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


# The public names defined outside luopan.errors, by the module that defines them: imported on first use (PEP 562),
# so that ``import luopan`` stays light and a device that only pulls or applies patches (luopan.channel,
# luopan.patch) never imports the repository. ``luopan.Repo`` is luopan.repo.Repo itself, not a copy.
_EXPORTS = {
    "Artifact": "artifact", "ArtifactVersion": "artifact",
    "CheckpointInfo": "checkpoint", "SaveHandle": "checkpoint", "VerifyReport": "checkpoint",
    "DeltaPolicy": "checkpoint", "Run": "checkpoint", "Shard": "checkpoint",
    "Repo": "repo", "init": "repo", "open": "repo",
    "Lineage": "repository.lineage", "ColdPolicy": "repository.tiersetup",
}

if TYPE_CHECKING:  # pragma: no cover  (for type checkers and IDEs: the same names, resolved statically)
    from . import policies, retention
    from .artifact import Artifact, ArtifactVersion
    from .checkpoint import CheckpointInfo, DeltaPolicy, Run, SaveHandle, Shard, VerifyReport
    from .repo import Repo, init, open
    from .repository.lineage import Lineage
    from .repository.tiersetup import ColdPolicy


def __getattr__(name: str):  # noqa: ANN202 - module attribute hook (PEP 562)
    """``luopan.Repo`` (and the other names of _EXPORTS) and ``luopan.<submodule>`` (``luopan.policies``,
    ``luopan.torch``, ...) on first use: importing luopan imports no repository and no torch, nor requires torch to
    be installed."""
    import importlib.util

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    if name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'luopan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "CheckoutConflictError",
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

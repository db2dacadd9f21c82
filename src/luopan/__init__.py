"""luopan (落盘): atomic, verified, incremental persistence for AI runs.

    import luopan
    repo = luopan.open("ckpts")
    info = repo.save("run-a", step=100, state=state, metrics={"loss": 0.52})
    state = repo.load("run-a")
"""

from .checkpoint.repo import CheckpointInfo, Repo, SaveHandle, VerifyReport, init, open
from .checkpoint.rowdelta import DeltaPolicy
from .checkpoint.runrecord import Run
from .tier import ColdPolicy
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigConflictError,
    CorruptManifestError,
    CorruptPackError,
    CorruptRepoError,
    GcError,
    InsufficientSpaceError,
    IntegrityError,
    InvalidNameError,
    LayoutMismatchError,
    LockedError,
    LuopanError,
    MissingDependencyError,
    MissingPackError,
    NotARepositoryError,
    ObjectStoreError,
    ObjectTooLargeError,
    OutputPathError,
    RepoExistsError,
    RepoNotFoundError,
    StateMismatchError,
    StorageError,
    StorageFullError,
    UnreadableError,
    UnsupportedFormatError,
    UnsupportedValueError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ColdPolicy",
    "ConfigConflictError",
    "CorruptManifestError",
    "CorruptPackError",
    "CorruptRepoError",
    "DeltaPolicy",
    "GcError",
    "InsufficientSpaceError",
    "IntegrityError",
    "InvalidNameError",
    "LayoutMismatchError",
    "LockedError",
    "LuopanError",
    "MissingDependencyError",
    "MissingPackError",
    "NotARepositoryError",
    "ObjectStoreError",
    "ObjectTooLargeError",
    "OutputPathError",
    "Repo",
    "Run",
    "SaveHandle",
    "RepoExistsError",
    "RepoNotFoundError",
    "StateMismatchError",
    "StorageError",
    "StorageFullError",
    "UnreadableError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
    "UsageError",
    "VerifyReport",
    "init",
    "open",
]

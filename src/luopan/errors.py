"""The luopan exception hierarchy.

Every error a user can cause or meet derives from `LuopanError` and from the built-in exception it resembles, so
callers can catch either. The CLI maps these classes to exit codes in one table (luopan.cli.app.EXIT_CODES);
anything else reaching it is a bug. Extra fields an error carries are declared on its class.
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class LuopanError(Exception):
    """Base of every user-facing luopan error."""


class InvalidNameError(LuopanError, ValueError):
    """A run name, step or key path is not valid."""


class UsageError(LuopanError, ValueError):
    """An option or argument that cannot do what was meant (a negative timeout, a retention rule naming a metric no
    checkpoint records): nothing was changed. The CLI exits 2, as for a bad flag."""


class ArgumentTypeError(LuopanError, TypeError):
    """An argument of the wrong type (e.g. a policy where a retention rule is expected): nothing was changed."""


class PlanInputError(UsageError):
    """A size, rate, duration or option given to ``luopan plan`` cannot be understood, or conflicts with another."""


class RepoNotFoundError(LuopanError, FileNotFoundError):
    """No luopan repository at the given location."""


class RepoExistsError(LuopanError, FileExistsError):
    """`init` on a location that already holds a repository."""


class NotARepositoryError(LuopanError, FileExistsError):
    """Creating a repository in a directory that holds other files."""


class ConfigConflictError(LuopanError, ValueError):
    """Options given to `open` conflict with the existing repository's config."""


class ManifestNotFoundError(LuopanError, KeyError, LookupError):
    """What was asked for (a checkpoint, an artifact version, a ``NAME@N`` reference) is not committed."""

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(ManifestNotFoundError):
    """The run or step asked for has no committed checkpoint."""


class ArtifactNotFoundError(ManifestNotFoundError):
    """The artifact, version or file asked for is not committed."""


class UnsupportedFileError(LuopanError, ValueError):
    """A file an artifact commit was given cannot be stored as it is (a symbolic link, a device, a FIFO or socket, a
    path escaping the directory); the message names it. Nothing was committed."""


class PinnedError(LuopanError, RuntimeError):
    """Removing a pinned checkpoint (``luopan rm`` without ``--force``): nothing was removed. The message names the
    pinned steps and how to unpin them. The CLI exits 1."""


class CheckpointExistsError(LuopanError, FileExistsError):
    """Saving a step that already has a committed checkpoint without `overwrite=True`."""


class UnsupportedValueError(LuopanError, TypeError):
    """A state tree holds something luopan refuses to store (it never pickles)."""


class StateMismatchError(LuopanError, ValueError):
    """`load_into` target does not match the checkpoint (keys, shapes, dtypes)."""


class LayoutMismatchError(StateMismatchError):
    """A training state is restored under a different world size or parallel layout than it was saved with."""


class BaseMismatchError(StateMismatchError):
    """An adapter (or patch) meets a base model whose content fingerprint is not the one it was made for. The message
    names both; ``expected`` (what it was made for) and ``actual`` (the base given) carry them when known. Nothing
    was written."""

    expected: str | None = None
    actual: str | None = None


class UnsupportedFormatError(LuopanError, RuntimeError):
    """The repository or a file in it has a newer format_version than this luopan reads."""


class StorageError(LuopanError, OSError):
    """The store refused or failed an operation: permissions, a read-only filesystem, an I/O error, an unreachable
    object store. The message names the file or object and what to check; ``errno`` is the system's."""


class ObjectStoreError(StorageError):
    """An object-store request failed (network, permissions, missing bucket, server error)."""


class MissingDependencyError(LuopanError, ImportError):
    """An optional dependency needed for this kind of repository is not installed."""


class OutputPathError(LuopanError, OSError):
    """A file luopan was asked to write outside the repository (``export -o``) cannot be written there: its
    directory is missing, a directory is in the way, or permission is denied. Nothing was written."""


class ProbeError(StorageError):
    """The bandwidth probe of ``luopan plan`` could not write, fsync or remove its temporary file."""


class ReplicationError(LuopanError, RuntimeError):
    """A checkpoint could not be replicated to another tier, or its copy there did not verify."""


class StorageFullError(StorageError):
    """The store ran out of space during a save; nothing partial was committed."""


class InsufficientSpaceError(StorageFullError):
    """The space preflight of a save found less free space than the estimated new bytes times the margin; nothing
    was written. ``needed``, ``free``, ``estimate`` (bytes) and ``gc_frees`` / ``prune_frees`` say what would help."""

    needed: int | None = None
    free: int | None = None
    estimate: int | None = None
    gc_frees: int | None = None
    prune_frees: int | None = None


class IntegrityError(LuopanError, ValueError):
    """Stored data does not match its recorded hash or structure. From ``verify``: ``problems`` lists every one
    found and ``report`` is the VerifyReport; a problem of one chunk names it in ``chunk`` (a ChunkRef)."""

    problems: list[Any] | None = None
    report: Any = None
    chunk: Any = None


class CorruptPackError(IntegrityError):
    """A pack file is truncated or damaged."""


class MissingPackError(IntegrityError, FileNotFoundError):
    """A pack a manifest needs is not in the store."""


class CorruptManifestError(IntegrityError):
    """A manifest cannot be parsed, fails its checksum or its schema."""


class CorruptRepoError(IntegrityError):
    """The repository config, an index file or a ref is damaged."""


class ObjectTooLargeError(IntegrityError):
    """A file luopan reads whole (a manifest, index file, ref, record…) is larger than any valid one of its kind
    (docs/format.md §11): it was refused before being read."""


class UnreadableError(IntegrityError):
    """``verify`` could not read part of the repository (permissions, an I/O error), so it cannot vouch for it."""


class SignatureError(IntegrityError):
    """A signature does not verify: the signed bytes were changed, or it was made with another key."""


class UntrustedKeyError(SignatureError):
    """A signature made by a key that is not in the trusted keys (``--trusted-keys DIR`` / LUOPAN_TRUSTED_KEYS)."""


class UnsignedError(SignatureError):
    """Something unsigned where trusted keys are given, so a signature by one of them is required."""


class CorruptPatchError(IntegrityError):
    """A patch file (docs/format.md §13) is not one, is truncated or damaged, breaks a limit, or holds a chunk that
    does not match its hash. Nothing was written; an existing output file is untouched."""


class CorruptSafetensorsError(IntegrityError):
    """A safetensors file luopan reads (a patch's base) is not a valid one: its header is damaged, oversized, or
    describes tensors outside the file. Nothing was written."""


class LockedError(LuopanError, TimeoutError):
    """The repository is locked (by a prune/gc, or by saves when we want the exclusive lock) for longer than we were
    willing to wait. The message names the holders and how to remove a stale lock."""


class CollectiveError(LuopanError, RuntimeError):
    """A collective save (``repo.save(..., group=…)``) failed on some rank, or lost contact with one (the message
    names it); nothing was committed."""


class CollectiveStorageError(StorageError, CollectiveError):
    """A collective save failed because the store failed on some rank (an I/O error): raised on every rank, the
    ranks' StorageError (``errno`` the system's) as well as a CollectiveError; the message names the rank, the file
    and what to do. Nothing was committed."""


class CollectiveStorageFullError(StorageFullError, CollectiveStorageError):
    """A collective save failed because a rank's store ran out of space (or quota): raised on every rank, so that
    all of them can free space and save again together. Nothing was committed."""


class GcError(LuopanError, RuntimeError):
    """Garbage collection cannot run safely (e.g. a damaged manifest: gc cannot tell what that checkpoint needs)."""


class CorruptChannelIndexError(IntegrityError):
    """An update channel's ``index.json`` (docs/format.md §15) is not one: larger than its limit, not canonical JSON,
    nested too deeply, a member given twice, of the wrong type or range, or naming an unsafe file. It was refused
    before anything was downloaded or written."""


class ChannelRollbackError(IntegrityError):
    """A channel index older than the newest this device has seen (its state file), or one of another channel: a
    replayed or substituted index (TUF's rollback rule). Nothing was written."""


class ChannelExpiredError(IntegrityError):
    """A channel index past its expiry time: the channel is frozen or the index replayed (TUF's freeze rule). The
    publisher must publish again (publishing the same step renews the expiry). Nothing was written."""


class ChannelStateError(IntegrityError):
    """A device's channel state file (``--state``) is damaged, is not one, or cannot be written."""


class CorruptDownloadError(IntegrityError):
    """A downloaded file does not match the size or BLAKE3 that the signed channel index gives it. The partial file
    was deleted: a rerun downloads it again."""


class ChannelDownloadError(LuopanError, ConnectionError):
    """A channel file could not be fetched (the server is unreachable, the connection was cut, a file is missing).
    The bytes downloaded so far are kept next to the output: the same pull run again downloads only the rest.
    ``missing`` is true when the server answered that the file does not exist (the channel changed meanwhile)."""

    missing: bool = False


class CorruptJournalError(IntegrityError):
    """A journal segment is damaged where it cannot be a torn tail (docs/format.md §16): a record other than the last
    ones written is unreadable, or a segment is missing. ``segment`` and ``offset`` name where. Nothing was cut."""

    segment: str = ""
    offset: int = 0


class JournalBusyError(LuopanError, BlockingIOError):
    """Another process (or another Journal object of this one) has the journal open for writing: a journal has one
    writer at a time. Close the other one, or open this one with ``read_only=True``."""


class RecordNotFoundError(ManifestNotFoundError):
    """No record with that sequence number: it is past the end of the journal, or it was compacted into a snapshot
    (read the snapshot with ``latest_snapshot()``, then the records from its ``seq``)."""


class InvalidPathError(UnsupportedFileError, InvalidNameError, UsageError):
    """A file an artifact commit was given has a name the name rule refuses (docs/format.md §2: a backslash, a
    control character such as a newline, a '.' or '..' part, a name that is not valid UTF-8…). The message names it,
    escaped; nothing was written. The CLI exits 2."""


class SourceChangedError(UnsupportedFileError):
    """A file or directory changed while an artifact commit was reading it (replaced by a symbolic link, a FIFO or
    another file after it was listed). Nothing was committed and no link was followed; commit again once it is still.
    ``path`` names it."""

    path: str = ""


class CheckoutConflictError(LuopanError, FileExistsError):
    """An artifact checkout into an existing folder would overwrite or remove local changes: files edited since the
    last checkout, or files it does not know in the way of the version. Nothing was changed; ``paths`` lists them
    (relative to the folder). Commit them first, or check out with ``force=True`` (``--force``) to discard them."""

    paths: list[str] = []


class ManifestNameError(CorruptManifestError):
    """A manifest (written by an older luopan) names a file the name rule refuses (docs/format.md §2); everything else
    in it is valid. It cannot be loaded as it is; ``doc`` is what it references, so gc keeps that data."""

    doc: Any = None


class CleanupWarning(UserWarning):
    """A write luopan already committed could not tidy up after itself (a temporary file it could not remove, a file
    descriptor whose close failed, an op log it could not trim). Nothing committed is lost and the operation
    reports success; leftovers are removed later (temporary files of gone writers at the next write or gc). Also
    logged to the ``luopan`` logger."""


_REMEDIES = {
    (_errno.ENOSPC, _errno.EDQUOT): "free space on its disk (or raise the quota)",
    (_errno.EROFS,): "its file system is mounted read-only: remount it read-write, or use another place",
    (_errno.EACCES, _errno.EPERM): "check the owner and mode of the path (this user may not write there)",
    (_errno.EFBIG,): "the file is larger than its file system or the process limit allows (e.g. FAT32's 4 GiB): use "
                     "another file system or raise the limit (ulimit -f)",
    (_errno.EMFILE, _errno.ENFILE): "too many files are open: raise the limit (ulimit -n) or close other programs",
    (_errno.ENAMETOOLONG,): "a name on the path is too long for its file system: use a shorter path",
    (_errno.ENOENT, _errno.ENOTDIR): "a directory on the path is missing or is not a directory: check the path",
}


def os_remedy(code: int | None) -> str:
    """What to do about an OSError with errno ``code`` met while writing: one clause, for messages ("…; {remedy},
    then try again"). The system's own reason is given beside it by the caller."""
    for codes, remedy in _REMEDIES.items():
        if code in codes:
            return remedy
    return "check the disk (the system log names the device's errors)"

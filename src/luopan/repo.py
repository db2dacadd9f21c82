"""``luopan.open`` and ``luopan.Repo``: one repository holding every kind (checkpoints, artifacts), on the kind-agnostic
core (luopan.repository)."""

from __future__ import annotations

import os
from typing import Any

from .artifact.api import Artifacts
from .artifact.kind import ARTIFACTS_KIND
from .checkpoint.api import Checkpoints
from .checkpoint.collective import Collective
from .checkpoint.kind import CHECKPOINTS
from .checkpoint.rowdelta import DeltaPolicy
from .errors import UsageError
from .format.config import Compression, RepoConfig
from .index.kind import INDEX_KIND
from .journal.api import Journal
from .journal.kind import JOURNAL_KIND
from .repository.locks import DEFAULT_TIMEOUT
from .repository.opening import check_new, check_open_options, connect
from .repository.preflight import DEFAULT_SPACE_MARGIN
from .repository.tiersetup import attach
from .store import Store


class Repo(Collective, Checkpoints, Artifacts):
    """A luopan repository: checkpoints of runs and versioned artifacts, sharing one content-addressed store.
    Not safe for concurrent writes from several threads of one process."""

    kinds = (ARTIFACTS_KIND, CHECKPOINTS, JOURNAL_KIND, INDEX_KIND)  # resolve() tries them in this order

    def __init__(self, store: Store, config: RepoConfig, delta_policy: DeltaPolicy | None = None) -> None:
        Checkpoints.__init__(self, store, config, delta_policy)

    def journal(self, name: str = "main", fsync: str = "always", **options: Any) -> Journal:
        """The journal ``name`` of this repository, opened for appending (docs/format.md §16); see
        ``luopan.journal.Journal`` for ``fsync`` and the other options."""
        return Journal(self, fsync, name=name, **options)


def open(  # noqa: A001  (the public verb is luopan.open)
    location: str | os.PathLike[str] | Store,
    *,
    create: bool = True,
    chunk_size: int | None = None,
    pack_size: int | None = None,
    compression: str | Compression | None = None,
    delta_policy: DeltaPolicy | None = None,
    replicate_to: str | os.PathLike[str] | Store | None = None,
    local_retention: Any = None,
    cold: Any = None,
    storage_options: dict[str, Any] | None = None,
    replicate: bool = True,
    lock_timeout: float | None = DEFAULT_TIMEOUT,
    space_margin: float = DEFAULT_SPACE_MARGIN,
    read_check: str = "blake3",
    progress: bool = True,
) -> Repo:
    """Open the repository at a path/URL, creating it (with the given options) when missing and ``create``.

    Options apply at creation; on an existing repository, an option that differs from its config is an error.
    ``delta_policy`` (not stored: it steers this process's saves) says which tables are stored as row deltas.

    Tiered storage (docs/format.md §10.2): ``replicate_to`` (a URL or path, recorded in the local
    ``tier/config.json`` so later opens need not repeat it) gets every committed checkpoint and artifact version
    copied in the background; ``local_retention`` (luopan.retention rules) evicts local copies once the remote has
    them; ``cold=luopan.ColdPolicy(url, older_than="7d")`` names where ``repo.apply_cold_policy()`` moves old ones.
    ``lock_timeout`` (seconds, default 600; None waits forever) is how long a write waits for a prune/gc holding the
    exclusive lock, and prune/gc for writes (docs/format.md §9.2). ``space_margin`` (default 1.5; 0 turns it off):
    a write first checks that the disk has this many times its estimated new bytes free (§10.4). ``read_check``:
    loads check every chunk against its BLAKE3 address ("blake3", the default); "xxh3" (opt-in, for a repository
    that never leaves this machine) checks it against the XXH3-128 its manifest row lists instead: damage is caught
    as surely, for ~10x less CPU, but a crafted repository is not (docs/format.md §5.1). `verify` always uses BLAKE3.
    ``storage_options`` go to the object-store filesystem of the repository's URL and of those URLs (e.g.
    ``{"endpoint_url": …, "key": …, "secret": …}`` for S3). ``replicate=False`` opens a tiered
    repository without starting replication (reads still fall back to the remote; used by the CLI).
    ``progress=False``: saves never report on stderr (by default one that runs longer than two seconds shows a bar on
    a terminal and one line once committed; luopan.checkpoint.progress). The ``luopan`` logger's records stay.
    """
    check_open_options(lock_timeout, space_margin)
    if read_check not in ("blake3", "xxh3"):
        raise UsageError(f"read_check must be 'blake3' (the default) or 'xxh3', got {read_check!r}")
    store, config, tiering = connect(location, create=create, chunk_size=chunk_size, pack_size=pack_size,
                                     compression=compression, replicate_to=replicate_to,
                                     local_retention=local_retention, cold=cold, storage_options=storage_options)
    repo = Repo(store, config, delta_policy)
    repo.lock_timeout = lock_timeout
    repo.space_margin = space_margin
    repo.read_check = read_check
    repo.progress = bool(progress)
    if tiering is not None:
        attach(repo, tiering, start=replicate)
    return repo


def init(location: str | os.PathLike[str] | Store, **options: Any) -> Repo:
    """Create a new repository; RepoExistsError if one is already there."""
    return open(check_new(location), **options)

"""What the checks of ``luopan doctor`` share: the repository opened read-only, the probes a test can replace, and
the newest manifest of each series and the lock records, each read once.

Opening for doctor differs from ``luopan.open``: nothing is written. ``luopan.open`` removes temp files of dead
writers and may record tier settings or create the remote repository; doctor reports those leftovers instead, and
never touches the remote (replication status comes from the local records, docs/format.md §10.2).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LuopanError, RepoNotFoundError
from ..format.config import RepoConfig
from ..format.limits import MAX_CONFIG_BYTES
from ..format.names import CONFIG_KEY
from ..repo import Repo
from ..repository.kinds import Kind
from ..repository.lockrecords import LockRecord, list_locks
from ..repository.opening import check_local_root
from ..store import Store, open_store
from ..store.base import KeyNotFound
from ..store.tiered import TieredStore


def open_readonly(location: str | os.PathLike[str] | Store) -> Repo:
    """The repository at ``location``, opened without writing anything (no temp-file cleanup, no tier setup).
    RepoNotFoundError when there is none; errors of a damaged or newer config as ``luopan.open`` raises them."""
    store = open_store(location)
    check_local_root(store, False)
    where = store.describe()
    try:
        data = store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
    except KeyNotFound:
        raise RepoNotFoundError(
            f"no luopan repository at {where}: create one with `luopan init -r {where}` or luopan.open(path)"
        ) from None
    return Repo(store, RepoConfig.from_bytes(data, where))


def local_store(store: Store) -> Store:
    """The store a repository's own files are on (a tiered repository's local tier)."""
    return store.local if isinstance(store, TieredStore) else store


@dataclass
class Newest:
    """The newest committed manifest of one series of one kind, as read (``doc``) or why it could not be."""

    kind: Kind
    series: str
    number: int
    doc: dict[str, Any] | None
    error: Exception | None

    def label(self) -> str:
        return self.kind.label(self.series, self.number)


@dataclass
class Context:
    """One doctor run over ``repo``. ``free_bytes(store)``, ``mount_of(path)`` and ``now()`` are the probes tests
    replace (a full disk, a network filesystem, a clock)."""

    repo: Repo
    full: bool
    free_bytes: Callable[[Store], int | None]
    mount_of: Callable[[str], Any]
    now: Callable[[], float] = time.time
    _newest: list[Newest] | None = field(default=None, repr=False)
    _locks: list[LockRecord] | None = field(default=None, repr=False)

    @property
    def local(self) -> Store:
        return local_store(self.repo.store)

    @property
    def where(self) -> str:
        return self.local.describe()

    def newest(self) -> list[Newest]:
        """The newest manifest of every series of every kind found locally (read once per run of doctor)."""
        if self._newest is None:
            found = []
            for kind in self.repo.kinds:
                cat = kind.scan(self.local, None, False)
                for series in cat.runs:
                    number = cat.steps[series][-1]
                    try:
                        doc, error = self.repo.repository.read_manifest(kind, series, number), None
                    except (LuopanError, OSError) as exc:  # damaged, newer or unreadable: a finding of `verify`
                        doc, error = None, exc
                    found.append(Newest(kind, series, number, doc, error))
            self._newest = found
        return self._newest

    def locks(self) -> list[LockRecord]:
        if self._locks is None:
            self._locks = list_locks(self.local)
        return self._locks

    def command(self, verb: str) -> str:
        """A luopan command line for this repository, e.g. ``luopan unlock -r /data/ckpts``."""
        return f"`luopan {verb} -r {self.where}`"

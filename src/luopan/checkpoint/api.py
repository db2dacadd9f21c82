"""The checkpoint kind's verbs on a repository: ``save``/``save_async``, listing, ``load``/``load_into``,
``export``/``diff``, ``verify``, ``prune``, runs' records and pins (luopan.Repo combines them with other kinds)."""

from __future__ import annotations

from ..repository.core import RepositoryCore
from ..store.base import Store
from ..format.config import RepoConfig
from .maintaining import Maintaining
from .rowdelta import DeltaPolicy


class Checkpoints(Maintaining):
    """Checkpoints of runs in a repository."""

    def __init__(self, store: Store, config: RepoConfig, delta_policy: DeltaPolicy | None = None) -> None:
        RepositoryCore.__init__(self, store, config)
        self._init_saving(delta_policy)

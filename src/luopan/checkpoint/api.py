"""The checkpoint kind's public face on a repository: ``save``/``save_async``, listing, ``load``/``load_into``,
``export``/``diff``, ``verify``, ``prune``, runs' records and pins, checkpoints written in parts and by several ranks
(luopan.Repo composes it with the other kinds)."""

from __future__ import annotations

from ..repository.core import Repository
from .distributed.collective import Collective
from .maintaining import Maintaining
from .rowdelta import DeltaPolicy


class Checkpoints(Collective, Maintaining):
    """The checkpoints of runs in one repository (``repo.checkpointing``), composed with its Repository."""

    def __init__(self, repository: Repository, delta_policy: DeltaPolicy | None = None) -> None:
        super().__init__(repository)
        self._init_saving(delta_policy)
        repository.drainers.append(self.drain)
        repository.releasers.append(self._release)

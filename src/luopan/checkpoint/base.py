"""What the checkpoint kind's parts share: the Repository it is composed with (docs/format.md §2a). The checkpoint
kind reaches the core only through these names; it never inherits the core."""

from __future__ import annotations

from typing import Any

from ..format.config import RepoConfig
from ..format.pack import BlobLocation
from ..repository.core import Repository
from ..repository.kinds import Kind
from ..repository.packwriter import PackChecker
from ..repository.transaction import Transaction
from ..store.base import Store


class CheckpointBase:
    """The checkpoint kind on one Repository (luopan.checkpoint.Checkpoints builds on it)."""

    def __init__(self, repository: Repository) -> None:
        self.repository = repository

    def __repr__(self) -> str:
        return f"luopan.checkpoint.Checkpoints({self.where!r})"

    # the core's state, read through (never copied: require_format replaces the config)
    @property
    def store(self) -> Store:
        return self.repository.store

    @property
    def config(self) -> RepoConfig:
        return self.repository.config

    @property
    def where(self) -> str:
        return self.repository.where

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return self.repository.kinds

    @property
    def tier(self) -> Any:
        return self.repository.tier

    @property
    def lock_timeout(self) -> float | None:
        return self.repository.lock_timeout

    @property
    def space_margin(self) -> float:
        return self.repository.space_margin

    def transaction(self, kind: Kind, series: str, number: int | None, **options: Any) -> Transaction:
        return self.repository.transaction(kind, series, number, **options)

    def chunk_index(self) -> dict[str, BlobLocation]:
        return self.repository.chunk_index()

    def pack_checker(self) -> PackChecker:
        return self.repository.pack_checker()

    @property
    def index_generation(self) -> int:
        return self.repository.index_generation

    def forget_damaged(self, problems: list[Any]) -> None:
        self.repository.forget_damaged(problems)

    def resolve(self, text: str, what: str = "input") -> tuple[Kind, str, int]:
        return self.repository.resolve(text, what)

    def read_manifest(self, kind: Kind, series: str, number: int) -> dict[str, Any]:
        return self.repository.read_manifest(kind, series, number)

    def drain(self) -> None:
        """Wait for this kind's work in flight (its background saves)."""

    def _release(self) -> None:
        """Free what this kind holds (background threads, buffers) once nothing is in flight."""

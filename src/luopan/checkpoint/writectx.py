"""What a checkpoint save works with and returns (the save pipeline itself is luopan.checkpoint.pipeline)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..format.config import RepoConfig
from ..format.pack import BlobLocation
from ..repository.chunkwriter import ChunkWriter
from ..store.base import Store
from .carry import Basis
from .rowdelta import DeltaPolicy, RowTrack


@dataclass
class SaveResult:
    manifest_key: str
    doc: dict[str, Any]
    new_locations: dict[str, BlobLocation]
    index_key: str | None  # the index file this save wrote (its chunks are new_locations)
    tracks: dict[str, RowTrack] = field(default_factory=dict)  # row-delta state of table entries after this save
    basis: Basis | None = None  # what the run's next save compares with (carry.Basis)


@dataclass
class WriteContext:
    """What a save knows besides its request: the repository, the chunks it holds, and this process's history of the
    run (the previous save's rows for XXH3 change detection, row-delta tracks)."""

    store: Store
    config: RepoConfig
    known: dict[str, BlobLocation]  # chunk hash -> location, from the index files
    chunks: Callable[[], ChunkWriter]  # a chunk writer of the save's transaction (one per attempt)
    commit: Callable[[bytes, bool], bool]  # the transaction's manifest put: (sealed bytes, overwrite) -> placed
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> entry of this run's previous save
    tracks: dict[str, RowTrack] = field(default_factory=dict)  # path -> row-delta state (docs/format.md §5.2)
    policy: DeltaPolicy = field(default_factory=DeltaPolicy)
    bad_bases: set[str] = field(default_factory=set)  # chunks that failed verification when read back as a base
    started: float | None = None  # time.monotonic() of the save call: the manifest records the save's duration
    stall: float | None = None  # seconds save_async blocked its caller (None: a synchronous save, blocked throughout)
    progress: Callable[[int], None] | None = None  # called with the bytes of each chunk hashed
    # The run's previous save (carry.Basis: entries with rows naming pack ids, its groups): unchanged entries keep
    # sharing entry groups (§8.5), and entries it is told are unchanged are carried unread
    basis: Basis | None = None
    generation: int = 0  # the repository's chunk index generation when ``known`` was read
    # group hash -> (pack id, offset, that pack's signature as found intact) when the blob was last read back and
    # found intact (§8.5): named again without a read while the pack stays as it was (shared across saves)
    checked_groups: dict[str, tuple[str, int, tuple[int, ...]]] = field(default_factory=dict)

"""What a gc run found and did (luopan.repository.gc)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GcReport:
    """What a gc run found and did. Bytes are pack-file bytes."""

    dry_run: bool
    grace: float
    manifests: int = 0
    stray_manifests: int = 0  # readable manifests under stray run directories: what they name is kept
    packs: int = 0
    pack_bytes: int = 0
    live_packs: int = 0
    live_bytes: int = 0  # bytes of live blobs (what the checkpoints need)
    repacked_packs: int = 0
    repacked_bytes: int = 0  # bytes of the packs repacked (they are condemned afterwards)
    copied_bytes: int = 0  # live blob bytes copied into new packs
    new_packs: int = 0
    manifests_rewritten: int = 0
    index_files_before: int = 0
    index_files_after: int = 0
    condemned_packs: int = 0  # waiting for their grace period after this run
    condemned_bytes: int = 0
    next_sweep_after: float | None = None  # unix time when the oldest waiting pack becomes deletable
    young_packs: int = 0  # unreferenced but younger than the grace period (maybe a save in progress)
    deleted_packs: int = 0
    deleted_bytes: int = 0
    skipped_repacks: list[str] = field(default_factory=list)  # packs not repacked (a damaged live blob), why
    # committed manifests that cannot be loaded as they are (a file name the name rule refuses, written by an older
    # luopan), each with why: what they reference is known, so it is kept and never repacked
    unloadable_manifests: list[str] = field(default_factory=list)
    dropped_links: int = 0  # lineage links (§9.4) whose manifest is gone or was replaced, deleted
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> wall time

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

"""The checkpoint kind as the repository core sees it (luopan.repository.kinds.Kind)."""

from __future__ import annotations

from typing import Any

from ..errors import IntegrityError, StorageError
from ..format.canonical import sealed_checksum
from ..format.limits import MAX_RECORD_BYTES, MAX_SMALL_BYTES
from ..format.manifest import parse_manifest
from ..format.manifestread import parse_manifest_shallow
from ..format.names import check_run, latest_ref_key, manifest_key, pin_key, record_key
from ..format.refs import build_ref, parse_ref
from ..repository.chunkio import blob_reader
from ..repository.kinds import Catalog, Kind
from ..store.base import KeyNotFound, Store
from ..store.tempfiles import cleanup_failed
from . import catalog


def _scan(store: Store, series: str | None, strays: bool) -> Catalog:
    return catalog.scan(store, series, strays=strays)


def _parse(data: bytes, key: str, run: str, step: int, store: Store | None = None) -> dict[str, Any]:
    return parse_manifest(data, key, run, step, None if store is None else blob_reader(store, f"manifest {key}")).doc


def _shallow(data: bytes, key: str, run: str | None, step: int | None) -> dict[str, Any]:
    return parse_manifest_shallow(data, key, run, step)


def _companions(run: str, step: int) -> list[tuple[str, int]]:
    return [(record_key(run), MAX_RECORD_BYTES), (pin_key(run, step), MAX_SMALL_BYTES)]


def _rewritten(store: Store, run: str, step: int, data: bytes) -> None:
    """Point the run's `latest` ref at a rewritten manifest, if it named this one (the ref is advisory)."""
    ref_key = latest_ref_key(run)
    try:
        ref = parse_ref(store.get_limited(ref_key, MAX_SMALL_BYTES), ref_key)
    except (KeyNotFound, IntegrityError, StorageError):
        return
    if ref.get("manifest") == manifest_key(run, step):
        try:
            store.put(ref_key, build_ref(run, step, sealed_checksum(data)))
        except OSError as exc:  # the rewritten manifest is committed: a stale ref is ignored, the next save repairs it
            cleanup_failed(f"the manifest of run {run!r} step {step} was rewritten, but its latest ref {ref_key} "
                           f"in {store.describe()} could not be updated ({exc}); readers ignore a stale ref and the "
                           "next save repairs it")


CHECKPOINTS = Kind(
    name="checkpoint", root=catalog.RUNS, series_noun="run", number_noun="step", manifest_key=manifest_key,
    scan=_scan, parse=_parse, pin_key=pin_key, check_series=check_run, companions=_companions, rewritten=_rewritten,
    shallow=_shallow,
    marker="",
)

"""Copying one manifest of any kind to another repository, verified (docs/format.md §10.2, "Replication order").

The copy protocol the replicator (tier.py) and cold moves share: the packs the manifest references that the
destination lacks (each verified: size and trailer hash == pack id), the index files naming them once all their packs
are there, the kind's companion files (``kind.companions``: a run's record and the pin), then the manifest last,
read back and compared — the commit point on the destination. ``ensure_repository`` makes the destination a
repository with the same ``repo_id`` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .._crash import crashpoint
from ..errors import ConfigConflictError, IntegrityError, ReplicationError, StorageError
from ..format import ENGINE2_FORMAT_VERSION
from ..format.canonical import ZSTD_MAGIC
from ..format.config import RepoConfig
from ..format.index import parse_index
from ..format.limits import (
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SMALL_BYTES,
)
from ..format.names import CONFIG_KEY, is_index_key, pack_key
from ..store import FsspecStore, Store
from ..store.base import KeyNotFound
from .chunkio import check_pack_trailer
from .kinds import Kind

UPLOAD_PART = 5 << 20  # object-store uploads of larger packs go in parts of this size, pausing between parts


def verify_small(dst: Store, key: str, data: bytes) -> None:
    """ReplicationError unless ``dst`` holds exactly ``data`` at ``key`` (read back)."""
    try:
        got = dst.get_limited(key, len(data))
    except IntegrityError as exc:  # larger than what was written
        raise ReplicationError(f"{key} on {dst.describe()} differs from what was written: {exc}") from None
    if got != data:
        raise ReplicationError(f"{key} on {dst.describe()} differs from what was written ({len(got)} bytes read "
                               f"back, {len(data)} written)")


def get_or_none(store: Store, key: str, limit: int) -> bytes | None:
    """The object, or None when it is missing or larger than ``limit`` (then it differs from anything we write)."""
    try:
        return store.get_limited(key, limit)
    except (KeyNotFound, IntegrityError):
        return None


def verify_pack(dst: Store, pack_id: str, size: int) -> None:
    """ReplicationError unless the pack on ``dst`` has ``size`` bytes and an intact trailer hashing to its id."""
    key = pack_key(pack_id)
    got = dst.size(key)  # KeyNotFound when it did not land: retried
    if got != size:
        raise ReplicationError(f"{key} on {dst.describe()} has {got} bytes, not {size}")
    problem = check_pack_trailer(dst, pack_id)
    if problem is not None:
        raise ReplicationError(f"{key} on {dst.describe()} did not land intact: {problem}")


def put_pack(src: Store, dst: Store, key: str, gate: Callable[[], None] | None) -> int:
    """Copy a pack from ``src`` to ``dst``; returns its size. On an object store a pack larger than UPLOAD_PART goes
    up as a multipart upload (visible only when completed, docs/format.md §10.1), read and sent part by part with
    ``gate()`` before each, so a save that starts while a pack is being sent competes with one part at most."""
    size = src.size(key)
    if gate is None or not isinstance(dst, FsspecStore) or size <= UPLOAD_PART:
        blob = src.get(key)
        dst.put_if_absent(key, blob)
        return len(blob)
    f = dst._call("put", key, dst._fs.open, dst._path(key), "wb", block_size=UPLOAD_PART)
    try:
        for off in range(0, size, UPLOAD_PART):
            gate()
            part = src.get_range(key, off, UPLOAD_PART)
            if len(part) != min(UPLOAD_PART, size - off):
                raise ReplicationError(f"{key} changed size while it was being sent")
            dst._call("put", key, f.write, part)
        gate()  # completing the upload costs the server a pass over the object too
        dst._call("put", key, f.close)
    except BaseException:
        with contextlib.suppress(Exception):  # if it fails, the bucket's lifecycle rule removes abandoned parts
            f.discard()  # abort the multipart upload: nothing becomes visible
        f.closed = True
        raise
    return size


class IndexMap:
    """pack id -> index files naming it, in a source store (index files are write-once: parsed once each)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._packs: dict[str, set[str]] = {}  # index key -> {pack ids}
        self._by_pack: dict[str, set[str]] = {}

    def lookup(self, src: Store, packs: set[str]) -> dict[str, set[str]]:
        """index key -> the pack ids it names, for every index file naming one of ``packs``."""
        if any(p not in self._by_pack for p in packs) or self._seen:
            keys = [k for k in src.list("index/") if is_index_key(k)]
            if not self._seen.issubset(keys):  # gc consolidated the index files: forget what they said
                self._seen.clear()
                self._packs.clear()
                self._by_pack.clear()
            if all(p in self._by_pack for p in packs):
                keys = []
            for key in keys:
                if key in self._seen:
                    continue
                try:
                    ids = index_packs(src, key)
                except (IntegrityError, KeyNotFound, StorageError):
                    continue
                self._seen.add(key)
                self._packs[key] = ids
                for p in ids:
                    self._by_pack.setdefault(p, set()).add(key)
        out: dict[str, set[str]] = {}
        for p in packs:
            for key in self._by_pack.get(p, ()):
                out[key] = self._packs[key]
        return out


def index_packs(src: Store, key: str) -> set[str]:
    """The pack ids an index file names (docs/format.md §7)."""
    return {loc.pack for loc in parse_index(src.get_limited(key, MAX_INDEX_BYTES), key).values()}


def _present(dst: Store, packs: list[str]) -> set[str]:
    """Which of ``packs`` exist on ``dst``: one HEAD each, many in flight (rank 0 of a collective save over N nodes
    checks every rank's packs: one after another, N round trips)."""
    if not packs:
        return set()

    def exists(p: str) -> str | None:
        return p if dst.exists(pack_key(p)) else None

    if len(packs) == 1:
        return {p for p in map(exists, packs) if p}
    with ThreadPoolExecutor(min(16, len(packs)), "luopan-heads") as pool:
        return {p for p in pool.map(exists, packs) if p}


def copy_manifest(src: Store, dst: Store, kind: Kind, series: str, number: int, *, indexes: IndexMap | None = None,
                  gate: Callable[[], None] | None = None, on_pack: Callable[[str, bool], None] | None = None,
                  commit: Callable[[Callable[[], None]], None] | None = None,
                  vouched: set[str] | None = None) -> bytes | None:
    """Copy manifest ``series``/``number`` of ``kind`` from ``src`` to ``dst`` and verify it there; returns the
    manifest bytes, or None when ``src`` no longer has it (pruned meanwhile).

    Order (docs/format.md §10.2): packs the manifest references that ``dst`` lacks (each verified: size and trailer
    hash == pack id; one already there is verified, and sent again if damaged), the index files naming them once all
    their packs are on ``dst``, the kind's companions (created once; the pin replaced), then the manifest (read back
    and compared) — the commit point on ``dst``. ``gate()`` is called before each pack (it may block while a save
    runs); ``on_pack(pack_id, sent)`` after each; ``commit(fn)`` runs the manifest step (to take a lock around it).
    A pack in ``vouched`` (seen verified on ``dst`` by the process that put it there: a rank of a collective save,
    ``publish_packs``) is only checked to still exist there.
    """
    mkey = kind.manifest_key(series, number)
    try:
        data = src.get_limited(mkey, MAX_MANIFEST_BYTES)
    except KeyNotFound:
        return None
    doc = kind.parse(data, mkey, series, number, src)  # never copy a damaged manifest
    packs = list(dict.fromkeys(doc["packs"]))
    there = _present(dst, [p for p in packs if vouched is not None and p in vouched])
    for pack_id in packs:
        if gate is not None:
            gate()
        key = pack_key(pack_id)
        if vouched is not None and pack_id in vouched:
            if pack_id in there:  # verified when it was put; under the caller's lock it stays
                if on_pack is not None:
                    on_pack(pack_id, False)
                continue
            vouched.discard(pack_id)
        if dst.exists(key):  # landed before (an earlier attempt, a killed process, another manifest)
            try:
                verify_pack(dst, pack_id, src.size(key))  # three small ranged reads, nothing re-sent
            except ReplicationError:
                dst.delete(key)  # damaged there: send it again below
            else:
                if on_pack is not None:
                    on_pack(pack_id, False)
                continue
        size = put_pack(src, dst, key, gate)
        try:
            verify_pack(dst, pack_id, size)
        except ReplicationError:
            dst.delete(key)  # never leave a damaged pack where a later attempt would take it as landed
            raise
        if on_pack is not None:
            on_pack(pack_id, True)
        crashpoint("tier.pack.landed")
    on_dst = set(packs)
    for ikey, named in sorted((indexes or IndexMap()).lookup(src, set(packs)).items()):
        if dst.exists(ikey):
            continue
        if all(p in on_dst or dst.exists(pack_key(p)) for p in named):  # rule 1: packs before their index
            try:
                idata = src.get_limited(ikey, MAX_INDEX_BYTES)
            except KeyNotFound:  # gc replaced it meanwhile: index files only steer dedup, skip it
                continue
            if idata.startswith(ZSTD_MAGIC):  # compressed (§4): older readers of dst must refuse the repository
                require_format(dst, ENGINE2_FORMAT_VERSION)
            dst.put_if_absent(ikey, idata)
            verify_small(dst, ikey, idata)
    pin = kind.pin_key(series, number)
    for key, limit in kind.companions(series, number):
        try:
            extra = src.get_limited(key, limit)
        except KeyNotFound:
            continue
        if key == pin:  # pins come and go (a tag may change): the source's is authoritative
            dst.put(key, extra)
        elif not dst.put_if_absent(key, extra):  # write-once files (a run's record): never replaced
            continue
        verify_small(dst, key, extra)

    def put_manifest() -> None:
        # an older reader of dst must refuse it, not miss this manifest (nor read a compressed one as damaged, §4)
        require_format(dst, max(doc["format_version"], ENGINE2_FORMAT_VERSION if data.startswith(ZSTD_MAGIC) else 0))
        if not dst.put_if_absent(mkey, data) and get_or_none(dst, mkey, MAX_MANIFEST_BYTES) != data:
            dst.put(mkey, data)  # saved again with overwrite=True: the source is authoritative
        verify_small(dst, mkey, data)

    if commit is not None:
        commit(put_manifest)
    else:
        put_manifest()
    return data


def publish_packs(src: Store, dst: Store, packs: list[str], index_keys: list[str],
                  known: set[str] | None = None) -> int:
    """Put ``packs`` that ``dst`` lacks there, each verified as in ``copy_manifest``, then ``index_keys`` (rule 1:
    packs before their index file); returns how many packs were sent. ``known`` holds ids this process has already
    seen verified on ``dst`` (no request for them) and gains every pack checked here. Takes no lock on ``dst``: these
    packs are not yet named by a manifest there, and whoever commits one (``copy_manifest``, under the shared lock)
    checks every pack it names again first."""
    sent = 0
    known = set() if known is None else known
    for pack_id in dict.fromkeys(packs):
        if pack_id in known:
            continue
        key = pack_key(pack_id)
        if not dst.exists(key):
            size = put_pack(src, dst, key, None)
            try:
                verify_pack(dst, pack_id, size)
            except ReplicationError:
                dst.delete(key)
                raise
            sent += 1
        known.add(pack_id)
    for ikey in index_keys:
        idata = src.get_limited(ikey, MAX_INDEX_BYTES)
        if idata.startswith(ZSTD_MAGIC):
            require_format(dst, ENGINE2_FORMAT_VERSION)
        if not dst.put_if_absent(ikey, idata):
            continue  # write-once and named by content: the same file
        verify_small(dst, ikey, idata)
    return sent


def ensure_repository(local: Store, dst: Store) -> None:
    """Make ``dst`` a repository with the local config (same repo_id), or check that it is one."""
    config = local.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
    mine = RepoConfig.from_bytes(config, local.describe())
    try:
        theirs = RepoConfig.from_bytes(dst.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), dst.describe())
    except KeyNotFound:
        if dst.put_if_absent(CONFIG_KEY, config):
            return
        theirs = RepoConfig.from_bytes(dst.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), dst.describe())
    if theirs.repo_id != mine.repo_id:
        raise ConfigConflictError(
            f"{dst.describe()} holds another luopan repository (repo_id {theirs.repo_id}, not {mine.repo_id}); "
            "replicate to an empty prefix or to a replica of this repository"
        )


def require_format(dst: Store, version: int) -> None:
    """Raise ``dst``'s config format_version to ``version`` (docs/format.md §1): a manifest of a newer kind must not
    land where a reader that does not know the kind (and whose gc would collect its chunks) still opens."""
    theirs = RepoConfig.from_bytes(dst.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), dst.describe())
    if theirs.format_version < version:
        dst.put(CONFIG_KEY, dataclasses.replace(theirs, format_version=version).to_bytes())


def copy_pin(src: Store, dst: Store, kind: Kind, series: str, number: int) -> None:
    """Copy the pin of a manifest to ``dst`` when ``src`` has one that ``dst`` lacks or holds differently."""
    key = kind.pin_key(series, number)
    try:
        pin = src.get_limited(key, MAX_SMALL_BYTES)
    except KeyNotFound:
        return
    if get_or_none(dst, key, MAX_SMALL_BYTES) != pin:
        dst.put(key, pin)

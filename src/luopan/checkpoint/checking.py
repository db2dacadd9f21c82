"""``luopan check`` (restic's ``check``): the repository's structure, and as much of its data as asked for.

Structure, always: every manifest of every kind parses and validates; every pack a manifest names exists, its
header, footer and trailer index are intact (the trailer hashes to the pack's id) and lists each chunk the manifest
reads from it at the same place; every index file parses and names only packs that exist; each run's record, eval
logs, pins and ``latest`` ref parse, and refs and pins name committed manifests. Data, when asked: the BLAKE3 of a
random fraction of the distinct chunks (``10%``), of one group of packs (``N/M``, as restic: packs split in M
groups by id, group N read), or of all of them — the same reads ``verify`` does (luopan.repository.verify).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CorruptPackError,
    CorruptRepoError,
    IntegrityError,
    LuopanError,
    MissingPackError,
    StorageError,
    UnreadableError,
    UnsupportedFormatError,
    UsageError,
)
from ..format.index import parse_index
from ..format.limits import MAX_INDEX_BYTES, MAX_SMALL_BYTES
from ..format.names import is_index_key, latest_ref_key, pack_key
from ..format.pack import PackFormatError
from ..format.refs import parse_ref
from ..repository.chunkio import ChunkRef, read_trailer, verify_chunks
from ..repository.logcheck import log_problems
from ..repository.pins import numbered_files, pin_prefix, pin_problems
from ..repository.verify import as_problem, manifest_chunk_refs, patch_problems
from ..store.base import KeyNotFound
from .kind import CHECKPOINTS


@dataclass(frozen=True)
class Subset:
    """Which data ``check`` reads: ``all``, a ``fraction`` of the chunks at random, or pack group ``n`` of ``m``."""

    text: str
    fraction: float | None = None
    group: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> Subset:
        """``10%`` / ``0.5%`` / ``100%``, or ``N/M`` (1 <= N <= M); UsageError otherwise."""
        t = text.strip()
        try:
            if t.endswith("%"):
                pct = float(t[:-1])
                if math.isfinite(pct) and 0 < pct <= 100:
                    return cls(t, fraction=pct / 100)
            elif "/" in t:
                n, m = (int(x) for x in t.split("/", 1))
                if 1 <= n <= m:
                    return cls(t, group=(n, m))
        except ValueError:
            pass
        raise UsageError(f"--read-data-subset takes a percentage (e.g. 10%, 0.5%) or N/M (e.g. 1/5: the first of "
                         f"five groups of packs), got {text!r}")

    def pick(self, refs: list[ChunkRef], rng: random.Random | None = None) -> list[ChunkRef]:
        if self.group is not None:
            n, m = self.group
            return [r for r in refs if int(r.pack[:8], 16) % m == n - 1]
        if self.fraction is None or self.fraction >= 1:
            return list(refs)
        k = min(len(refs), math.ceil(len(refs) * self.fraction))
        chosen = set((rng or random.SystemRandom()).sample(range(len(refs)), k))
        return [r for i, r in enumerate(refs) if i in chosen]


ALL = Subset("all", fraction=1.0)


@dataclass
class CheckReport:
    """What ``check`` looked at and every problem it found (it does not raise them)."""

    manifests: int = 0
    packs: int = 0
    chunks: int = 0
    index_files: int = 0
    subset: str | None = None  # None: structure only
    chunks_read: int = 0
    bytes_read: int = 0
    problems: list[LuopanError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # not damage: e.g. a stale latest ref (readers ignore it, §9)

    def to_json(self) -> dict[str, Any]:
        return {"ok": not self.problems, "manifests": self.manifests, "packs": self.packs, "chunks": self.chunks,
                "index_files": self.index_files, "read_data": self.subset, "chunks_read": self.chunks_read,
                "bytes_read": self.bytes_read,
                "problems": [{"type": type(p).__name__, "message": str(p)} for p in self.problems],
                "notes": list(self.notes)}


def check(repo: Any, subset: Subset | None = None, *, progress: Callable[[int], Any] | None = None,
          on_total: Callable[[int], Any] | None = None) -> CheckReport:
    """Check ``repo``'s structure, and with ``subset`` that part of its data (``progress(n)``: bytes of each chunk
    read, after ``on_total(bytes to read)``). Returns a CheckReport listing every problem."""
    repo.drain()
    store = repo.store
    rep = CheckReport(subset=subset.text if subset is not None else None)
    problems = rep.problems
    problems += [UnreadableError(f"cannot check {s}: manifests there cannot be seen")
                 for s in repo.strays(everywhere=True) if s.unreadable]
    refs: dict[str, ChunkRef] = {}
    committed: dict[Any, dict[str, set[int]]] = {}
    deltas: list[tuple[str, list[str], dict[str, Any]]] = []  # row deltas: their patches are read with the data
    for kind in repo.kinds:
        cat = kind.scan(store, None, False)
        committed[kind] = {s: set(ns) for s, ns in cat.steps.items()}
        for series, number in cat.pairs():
            rep.manifests += 1
            try:
                doc = repo.read_manifest(kind, series, number)
            except KeyNotFound:
                continue
            except (IntegrityError, UnsupportedFormatError, StorageError) as exc:
                problems.append(as_problem(exc))
                continue
            try:
                for ref in manifest_chunk_refs(kind, series, number, doc):
                    refs.setdefault(f"{ref.hash}/{ref.pack}/{ref.offset}", ref)
            except (IndexError, KeyError, TypeError, ValueError) as exc:
                problems.append(IntegrityError(f"{kind.label(series, number)}: a chunk row is damaged ({exc})"))
                continue
            deltas += [(kind.label(series, number), doc["packs"], e) for e in doc["entries"] if "delta" in e]
    rep.chunks = len(refs)
    by_pack: dict[str, list[ChunkRef]] = {}
    for ref in refs.values():
        by_pack.setdefault(ref.pack, []).append(ref)
    rep.packs = len(by_pack)
    for pack in sorted(by_pack):
        problems += _pack_problems(store, pack, by_pack[pack])
    problems += _index_problems(store, rep)
    problems += log_problems(repo)  # journal and op-log segments, as opening them would
    problems += _ref_and_pin_problems(repo, committed, rep.notes)
    if subset is not None:
        chosen = subset.pick(sorted(refs.values(), key=lambda r: (r.pack, r.offset)))
        rep.chunks_read = len(chosen)
        rep.bytes_read = sum(r.size for r in chosen)
        if on_total is not None:
            on_total(rep.bytes_read)
        chunk_problems = verify_chunks(store, chosen, progress)
        repo.forget_damaged(chunk_problems)
        problems += chunk_problems
        problems += patch_problems(store, deltas)  # what a load checks of a patch, as verify does
    return rep


def _pack_problems(store: Any, pack: str, refs: list[ChunkRef]) -> list[LuopanError]:
    """A pack's trailer intact, hashing to its id, and listing every chunk the manifests read from it."""
    try:
        computed, blobs = read_trailer(store, pack)
    except KeyNotFound:
        return [MissingPackError(f"missing pack: {refs[0].where()}: {pack_key(pack)} is not in the repository"
                                 + (f" ({len(refs) - 1} more chunk(s) need it)" if len(refs) > 1 else ""))]
    except PackFormatError as exc:
        return [CorruptPackError(f"pack {pack[:16]}… ({pack_key(pack)}): {exc}; needed by {refs[0].where()}")]
    except StorageError as exc:
        return [UnreadableError(f"pack {pack[:16]}… cannot be read: {exc}")]
    if computed != pack:
        return [CorruptPackError(f"pack {pack[:16]}… ({pack_key(pack)}): its trailer index is damaged (hashes to "
                                 f"{computed[:16]}…)")]
    listed = {(b["hash"], b["offset"], b["length"]) for b in blobs}
    for ref in refs:
        if (ref.hash, ref.offset, ref.length) not in listed:
            return [CorruptPackError(f"{ref.where()}: the pack's trailer does not list this chunk there")]
    return []


def _index_problems(store: Any, rep: CheckReport) -> list[LuopanError]:
    """Index files parse, and name only packs that exist (a save would deduplicate against a missing one)."""
    found: list[LuopanError] = []
    exists: dict[str, bool] = {}
    for key in store.list("index/"):
        if not is_index_key(key):
            continue
        rep.index_files += 1
        try:
            rows = parse_index(store.get_limited(key, MAX_INDEX_BYTES), key)
        except KeyNotFound:
            continue
        except (IntegrityError, StorageError) as exc:
            found.append(as_problem(exc))
            continue
        for pack in sorted({loc.pack for loc in rows.values()}):
            if pack not in exists:
                exists[pack] = store.exists(pack_key(pack))
            if not exists[pack]:
                found.append(CorruptRepoError(f"index file {key} names pack {pack[:16]}…, which is not in the "
                                              "repository: delete the index file (it only steers deduplication) "
                                              "or run `luopan gc`"))
                break
    return found


def _ref_and_pin_problems(repo: Any, committed: dict[Any, dict[str, set[int]]], notes: list[str]) -> list[Exception]:
    """Each run's record, evals, pins and ref parse; pins (of every kind) and refs name committed manifests."""
    store = repo.store
    found: list[Exception] = []
    for run in sorted(committed.get(CHECKPOINTS, {})):
        found += repo.run(run).problems()
    runs_with_refs = {k.split("/")[2] for k in store.list("refs/runs/")
                      if k.count("/") == 3 and k == latest_ref_key(k.split("/")[2])}
    for run in sorted(runs_with_refs):
        key = latest_ref_key(run)
        try:
            ref = parse_ref(store.get_limited(key, MAX_SMALL_BYTES), key)
        except (KeyNotFound, IntegrityError, StorageError, LuopanError, ValueError):
            if run not in committed.get(CHECKPOINTS, {}):  # damage is reported by the run's problems otherwise
                found.append(CorruptRepoError(f"ref {key} belongs to run {run!r}, which has no checkpoint"))
            continue
        if ref["step"] not in committed.get(CHECKPOINTS, {}).get(run, set()):
            notes.append(f"ref {key} names step {ref['step']} of run {run!r}, which is not committed: a stale ref, "
                         "ignored by readers (the manifests decide) and repaired by the run's next save")
    for kind in repo.kinds:
        root = pin_prefix(kind, "\x00").split("\x00", 1)[0]
        series_seen = {k[len(root):].rsplit("/", 1)[0] for k in store.list(root) if "/" in k[len(root):]}
        for series in sorted(series_seen):
            try:
                kind.check_series(series)
            except (LuopanError, ValueError):
                continue  # not this kind's (another kind's pins under the same root), or not luopan's
            have = committed.get(kind, {}).get(series, set())
            try:
                pinned = numbered_files(store, pin_prefix(kind, series))
            except (StorageError, ValueError):
                continue
            if kind is not CHECKPOINTS or series not in committed.get(CHECKPOINTS, {}):
                try:
                    found += pin_problems(store, kind, series)
                except (StorageError, ValueError):
                    pass
            for key, number in pinned:
                if number not in have:
                    found.append(CorruptRepoError(f"pin {key} protects {kind.label(series, number)}, which is not "
                                                  "committed"))
    return found

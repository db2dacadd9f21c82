"""Loading a collective checkpoint (docs/format.md §10.5) as one rank of the world that saved it — that rank's
per-rank values and shards, reading only their chunks — or whole, in one process: per-rank values as
``{"rank-<r>": …}`` dicts and sharded tensors assembled into one tensor of their global shape. A DCP checkpoint
(§8.4, luopan.checkpoint.distributed.dcpview) is loaded whole the same way, its shards assembled."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ... import typed
from ...errors import (
    CorruptManifestError,
    LayoutMismatchError,
    StateMismatchError,
    UsageError,
)
from ...format.manifest import Manifest
from ...format.names import join_path
from ...repository.chunkio import PackSizes, read_chunks
from ...tree import flatten, itemsize, new_array, unflatten
from .dcpview import layouts
from .ranks import Chunk, Ranks, Sharded, byte_span, region
from ..chunkplan import check_rows, entry_jobs
from ..destinations import fresh_arrays
from ..reading import writable_bytes
from .shards import unwrap

RANK_PREFIX = "rank-"


def check_world(ranks: Ranks, m: Manifest, rank: int, world: int) -> None:
    """Refuse a group whose ranks cannot each be given their own values."""
    where = f"run {m.run!r} step {m.step}"
    if ranks.sharded and world != ranks.world:
        raise LayoutMismatchError(
            f"{where} was saved by {ranks.world} ranks with sharded tensors (e.g. {next(iter(ranks.sharded))!r}); "
            f"this group has {world}: load it with {ranks.world} ranks, or without group (shards assembled into "
            "whole tensors) and shard those yourself; resharding on load is luopan.dcp's job (save through "
            "luopan.dcp.Writer)")
    if ranks.per_rank and rank >= ranks.world:
        raise UsageError(f"{where} was saved by {ranks.world} ranks and keeps per-rank values; rank {rank} has none: "
                         "load it with at most that many ranks, or without group")


def view(m: Manifest, ranks: Ranks, rank: int | None) -> tuple[dict[str, Any], list[Sharded]]:
    """``m``'s tree as ``rank`` sees it (None: the whole): a per-rank node becomes that rank's entry (whole: stays a
    dict of ranks), a sharded tensor's node ``{"entry": len(m.entries) + k}`` for the k-th of the list returned."""
    n = len(m.entries)
    found: list[Sharded] = []
    number: dict[str, int] = {}
    by_entries = {frozenset(c.entry for c in s.chunks): s for s in ranks.sharded.values()}

    def node(nd: dict[str, Any], path: str) -> dict[str, Any]:
        (tag, value), = nd.items()
        s = ranks.sharded.get(path)
        if s is None and tag == "dict" and value and all(set(v) == {"entry"} for _k, v in value):
            s = by_entries.get(frozenset(v["entry"] for _k, v in value))  # a tied alias of a sharded tensor
        if s is not None:
            if s.path not in number:
                number[s.path] = n + len(found)
                found.append(s)
            return {"entry": number[s.path]}
        if rank is not None and path in ranks.per_rank and tag == "dict":
            mine = dict(value).get(f"{RANK_PREFIX}{rank}")
            if mine is None:
                raise CorruptManifestError(f"manifest run {m.run!r} step {m.step}: per-rank value {path!r} has no "
                                           f"value for rank {rank}")
            return mine
        if tag == "dict":
            return {"dict": [[k, node(v, join_path(path, k))] for k, v in value]}
        if tag in ("list", "tuple"):
            return {tag: [node(v, join_path(path, i)) for i, v in enumerate(value)]}
        if tag == "typed":  # a dataclass or namedtuple keeps its fields' key paths (module luopan.typed)
            spec = dict(value)
            if spec.get("type") in typed.PLAIN and isinstance(spec.get("v"), dict):
                spec["v"] = node(spec["v"], path)
            return {"typed": spec}
        return nd

    return node(m.tree, ""), found


def leaves(tree: dict[str, Any], path: str = "") -> Iterator[tuple[str, int]]:
    """(key path, entry index) of every entry node of a tree."""
    (tag, value), = tree.items()
    if tag == "entry":
        yield path, value
    elif tag == "dict":
        for k, v in value:
            yield from leaves(v, join_path(path, k))
    elif tag in ("list", "tuple"):
        for i, v in enumerate(value):
            yield from leaves(v, join_path(path, i))
    elif tag == "typed" and isinstance(value, dict):
        inner = typed.children(value)
        if value.get("type") in typed.PLAIN:
            yield from (x for child in inner if isinstance(child, dict) for x in leaves(child, path))
        else:
            yield from (x for i, child in enumerate(inner) if isinstance(child, dict)
                        for x in leaves(child, join_path(path, i)))


def _source(m: Manifest, i: int) -> int:
    return m.entries[i].get("alias_of", i)


class _Batch:
    """One batch of read jobs (read together on both cores), and the copies to make once they are verified."""

    def __init__(self, m: Manifest, store: Any, sizes: PackSizes) -> None:
        self.m, self.store, self.sizes = m, store, sizes
        self.jobs: list[Any] = []
        self.copies: list[tuple[Any, tuple[slice, ...] | None, Any]] = []

    def entry(self, i: int, obj: Any, dest: memoryview | None) -> None:
        """Entry ``i`` into ``obj`` (through its bytes ``dest``, or a fresh array then copied when None)."""
        if dest is None:
            e = self.m.entries[i]
            fresh, dest = new_array(e["kind"], e["dtype"], e["shape"])
            self.copies.append((obj, None, fresh))
        self.jobs += entry_jobs(self.store, self.m, i, dest, self.sizes)

    def assemble(self, s: Sharded, obj: Any, dest: memoryview | None) -> None:
        """Every chunk of ``s`` into its region of ``obj`` (of the global shape): straight into ``dest`` where a chunk
        is one run of bytes there, else read fresh and copied into place."""
        if dest is None:
            fresh, dest = new_array(s.kind, s.dtype, list(s.size))
            self.assemble(s, fresh, dest)
            self.copies.append((obj, None, fresh))
            return
        item = itemsize(s.kind, s.dtype) or 1
        for c in s.chunks:
            span = byte_span(c, s.size, item)
            if span is not None:
                self.jobs += entry_jobs(self.store, self.m, c.entry, dest[span[0]:span[0] + span[1]], self.sizes)
            else:
                fresh, view_ = new_array(s.kind, s.dtype, list(c.sizes))
                self.jobs += entry_jobs(self.store, self.m, c.entry, view_, self.sizes)
                self.copies.insert(0, (obj, region(c), fresh))  # before any copy of obj itself into a target

    def run(self, via_scratch: bool = False) -> None:
        read_chunks(self.store, self.jobs, via_scratch=via_scratch, sizes=self.sizes)
        for obj, where, fresh in self.copies:
            if isinstance(obj, np.ndarray):
                obj[where if where is not None else ...] = fresh
            else:
                with sys.modules["torch"].no_grad():
                    (obj if where is None else obj[where]).copy_(fresh)


def load(repo: Any, m: Manifest, rank: int | None = None, world: int = 0) -> Any:
    """The state tree of collective checkpoint ``m`` for ``rank`` of a group of ``world`` (None: the whole)."""
    ranks = layouts(m)
    if not ranks.world:
        rank = None  # saved by no group (a DCP checkpoint): every rank loads it whole
    if rank is not None:
        check_world(ranks, m, rank, world)
    tree, found = view(m, ranks, rank)
    n = len(m.entries)
    mine = {n + k: s.of_rank(rank).entry for k, s in enumerate(found)} if rank is not None else {}
    used = {_source(m, mine.get(i, i)) for _p, i in leaves(tree) if i < n or rank is not None}
    whole = found if rank is None else []
    sizes = check_rows(repo.store, m, sorted(used | {c.entry for s in whole for c in s.chunks}))
    batch = _Batch(m, repo.store, sizes)
    objs: dict[int, Any] = {}
    order = sorted(used)
    fresh = fresh_arrays([(m.entries[i]["kind"], m.entries[i]["dtype"], m.entries[i]["shape"]) for i in order]
                         + [(s.kind, s.dtype, list(s.size)) for s in whole])  # read into where they end
    for i, (obj, dest) in zip(order, fresh):
        objs[i] = obj
        batch.entry(i, obj, dest)
    assembled = []
    for s, (obj, dest) in zip(whole, fresh[len(order):]):
        assembled.append(obj)
        batch.assemble(s, obj, dest)
    batch.run()

    def get(i: int) -> Any:
        if i >= n and rank is None:
            return assembled[i - n]
        i = _source(m, mine.get(i, i))
        return objs[i][()] if m.entries[i].get("scalar") else objs[i]

    return unflatten(tree, get, f"run {m.run!r} step {m.step}")


def load_into(repo: Any, m: Manifest, target: Any, *, strict: bool = True, rank: int | None = None,
              world: int = 0) -> Any:
    """Restore collective checkpoint ``m`` into ``target`` in place, as ``rank`` of ``world`` (None: the whole).
    A sharded tensor goes into a whole tensor (assembled), into this rank's local tensor (with ``rank``), or into a
    ``luopan.Shard``/``DTensor`` target holding the same shard as one that was saved. Every mismatch is reported
    together before any tensor is touched; each chunk is verified before it is copied into the target."""
    ranks = layouts(m)
    if not ranks.world:
        rank = None  # saved by no group (a DCP checkpoint): every rank loads it whole
    if rank is not None:
        check_world(ranks, m, rank, world)
    tree, found = view(m, ranks, rank)
    sources = dict(leaves(tree))
    local, declared = unwrap(target)
    _skeleton, targets = flatten(local)
    n = len(m.entries)
    problems, plan, seen = [], [], set()
    for leaf in targets:
        seen.add(leaf.path)
        src = sources.get(leaf.path)
        if src is None:
            if strict:
                problems.append(f"missing in checkpoint: {leaf.path!r}")
            continue
        if leaf.alias_of is not None:
            continue  # the same memory as an earlier target tensor
        layout = declared.get(id(leaf.obj))
        chunk: Chunk | None = None
        if src >= n:
            s = found[src - n]
            kind, dtype, shape = s.kind, s.dtype, s.size
            if layout is not None:
                chunk = s.at(tuple(layout[1]), tuple(leaf.shape)) if tuple(layout[0]) == s.size else None
                if chunk is None:
                    problems.append(f"{leaf.path!r}: the target is the shard at {list(layout[1])} of shape "
                                    f"{tuple(leaf.shape)} of a {tuple(layout[0])} tensor; the checkpoint has none "
                                    f"such of its {s.size} tensor (resharding on load is luopan.dcp's job)")
                    continue
            elif rank is not None:
                chunk = s.of_rank(rank)
            if chunk is not None:
                shape = chunk.sizes
        else:
            if layout is not None:
                problems.append(f"{leaf.path!r}: the target is a shard; the checkpoint holds the whole tensor: load "
                                "it whole and shard it (or save through luopan.dcp, which reshards on load)")
                continue
            e = m.entries[_source(m, src)]
            kind, dtype, shape = e["kind"], e["dtype"], tuple(e["shape"])
        if (kind, dtype, tuple(shape)) != (leaf.kind, leaf.dtype, tuple(leaf.shape)):
            problems.append(f"{leaf.path!r}: checkpoint has {kind} {dtype}{tuple(shape)}, target has {leaf.kind} "
                            f"{leaf.dtype}{tuple(leaf.shape)}")
        elif leaf.scalar:
            problems.append(f"{leaf.path!r}: a NumPy scalar cannot be updated in place; use load()")
        elif src >= n and chunk is None:
            plan.append((leaf, found[src - n], -1))  # the whole tensor, assembled into the target
        else:
            plan.append((leaf, None, chunk.entry if chunk is not None else _source(m, src)))
    if strict:
        problems += [f"unexpected in checkpoint (not in target): {p!r}" for p in sources if p not in seen]
    if problems:
        raise StateMismatchError(
            f"cannot load run {m.run!r} step {m.step} into the target ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems)
            + "\nfix the target, or pass strict=False to load only the keys both sides have")
    needed = {c.entry for _leaf, s, _i in plan if s is not None for c in s.chunks}
    needed |= {i for _leaf, s, i in plan if s is None}
    batch = _Batch(m, repo.store, check_rows(repo.store, m, sorted(needed)))
    for leaf, s, i in plan:
        if s is not None:
            batch.assemble(s, leaf.obj, writable_bytes(leaf))
        else:
            batch.entry(i, leaf.obj, writable_bytes(leaf))
    batch.run(via_scratch=True)
    return target

"""Sharded values in collective saves (docs/format.md §10.5): one rank's part of a bigger tensor.

A rank says which part it holds with ``luopan.Shard(tensor, global_shape, offsets)``; torch's ``DTensor`` (FSDP2,
tensor parallel) and legacy ``ShardedTensor`` say it themselves. A collective save stores each distinct shard once
(a shard replicated on several ranks, equal bytes, is written by one of them) under ``<path>/shard-<offsets>`` and
records the global layout in the manifest's ``ranks`` member (luopan.checkpoint.distributed.ranks).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any

from ...errors import ArgumentTypeError, CollectiveError, UsageError
from .ranks import cover_problem

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, offsets) of one rank's shard


class Shard:
    """This rank's part ``tensor`` (a torch tensor or NumPy array) of a tensor of shape ``global_shape``, starting at
    ``offsets`` (one per dimension). In ``repo.save(..., group=...)`` the ranks' shards are stored once each and
    loaded back assembled (one process) or as each rank's own part (``group=``). Only collective saves take it."""

    __slots__ = ("global_shape", "offsets", "tensor")

    def __init__(self, tensor: Any, global_shape: Any, offsets: Any) -> None:
        shape = getattr(tensor, "shape", None)
        if shape is None or not hasattr(tensor, "dtype"):
            raise ArgumentTypeError(f"luopan.Shard takes a torch tensor or NumPy array, not {type(tensor).__name__}")
        self.tensor = tensor
        self.global_shape = _ints(global_shape, "global_shape")
        self.offsets = _ints(offsets, "offsets")
        local = tuple(int(n) for n in shape)
        if not len(self.global_shape) == len(self.offsets) == len(local):
            raise UsageError(f"luopan.Shard: the tensor has {len(local)} dimensions, global_shape "
                             f"{len(self.global_shape)} and offsets {len(self.offsets)}; give one of each per "
                             "dimension")
        if any(o + n > g for o, n, g in zip(self.offsets, local, self.global_shape)):
            raise UsageError(f"luopan.Shard: a shard of shape {local} at offsets {self.offsets} does not fit in the "
                             f"global shape {self.global_shape}")

    def __repr__(self) -> str:
        return f"luopan.Shard(<{tuple(self.tensor.shape)}>, global_shape={self.global_shape}, offsets={self.offsets})"


def _ints(value: Any, name: str) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise ArgumentTypeError(f"luopan.Shard: {name} must be a sequence of ints, not "
                                f"{type(value).__name__}") from None
    try:
        if any(isinstance(n, bool) for n in out):
            raise TypeError
        out = tuple(operator.index(n) for n in out)
    except TypeError:
        raise ArgumentTypeError(f"luopan.Shard: {name} must hold ints, got {out!r}") from None
    if any(n < 0 for n in out):
        raise UsageError(f"luopan.Shard: {name} must not be negative, got {out}")
    return out


def shard_name(offsets: Any) -> str:
    """The key of a shard under its tensor's path: ``shard-<offsets joined by _>`` (as luopan.dcp names them)."""
    return "shard-" + "_".join(map(str, offsets))


def local_part(value: Any) -> tuple[Any, Layout] | None:
    """(local tensor, (global shape, offsets)) when ``value`` is a sharded value, else None."""
    if isinstance(value, Shard):
        return value.tensor, (value.global_shape, value.offsets)
    api = sys.modules.get("torch.distributed.tensor")  # imported by whoever made a DTensor; never imported here
    if api is not None and isinstance(value, api.DTensor):
        return _dtensor_part(value, api)
    st = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    if st is not None and isinstance(value, st.ShardedTensor):
        shards = value.local_shards()
        if len(shards) != 1:
            raise UsageError(f"a ShardedTensor with {len(shards)} local shards on this rank: a collective save keeps "
                             "one shard per rank; save it through luopan.dcp, which stores any layout")
        md = shards[0].metadata
        return shards[0].tensor, (tuple(value.metadata().size), tuple(int(o) for o in md.shard_offsets))
    return None


def _dtensor_part(value: Any, api: Any) -> tuple[Any, Layout]:
    for p in value.placements:
        if type(p) is not api.Shard and type(p) is not api.Replicate:  # _StridedShard subclasses Shard
            raise UsageError(f"a DTensor with placement {p}: a collective save stores Shard and Replicate "
                             "placements; redistribute it first (dt.redistribute(mesh, [Replicate()]) for a Partial "
                             "one), or save it through luopan.dcp")
    chunks = value.__create_chunk_list__()  # DCP's protocol: this rank's part of the global tensor
    local = value.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise UsageError("a DTensor whose local tensor is not one box of the global tensor: save it through "
                         "luopan.dcp")
    return local, (tuple(value.shape), tuple(int(o) for o in chunks[0].offsets))


def unwrap(state: Any) -> tuple[Any, dict[int, Layout]]:
    """``state`` with every sharded value in its dicts, lists and tuples replaced by its local tensor, and
    {id(local tensor): layout}. The same sharded value twice becomes the same local tensor (tied, stored once).
    Containers without sharded values are returned as they are."""
    found: dict[int, Layout] = {}
    seen: dict[int, Any] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, dict):  # an OrderedDict (a module's state_dict) too: flatten stores every dict alike
            new = {k: walk(v) for k, v in value.items()}
            return value if all(new[k] is v for k, v in value.items()) else new
        if type(value) in (list, tuple):
            items = [walk(v) for v in value]
            return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
        if id(value) in seen:
            return seen[id(value)]
        part = local_part(value)
        if part is None:
            return value
        local, layout = part
        seen[id(value)] = local
        found[id(local)] = layout
        return local

    return walk(state), found


@dataclass(frozen=True)
class Placed:
    """One distinct shard of a sharded tensor: where it lies, the rank that writes it, and every rank holding it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    owner: int
    ranks: tuple[int, ...]
    nbytes: int

    @property
    def name(self) -> str:
        return shard_name(self.offsets)


def place_shards(path: str, rows: list[Any], load: list[int]) -> list[Placed] | None:
    """Which rank writes each distinct shard of the tensor at ``path``, from every rank's report row ``(path, kind,
    dtype, local shape, nbytes, digest, layout)``; ``load`` (bytes assigned per rank) is updated. None for a tied
    alias of another sharded tensor. CollectiveError (the same on every rank) when the ranks' shards disagree."""
    def bad(why: str) -> CollectiveError:
        return CollectiveError(f"a collective save failed: the shards of {path!r} {why}; nothing was committed")

    plain = [r for r, row in enumerate(rows) if row[6] is None]
    if plain:
        raise bad(f"are a plain tensor on rank {plain[0]} but a shard on another rank; shard it on every rank")
    digests = {row[5] for row in rows}
    if any(d.startswith("alias:") for d in digests):
        if len(digests) != 1:
            raise bad("are tied to another tensor on some ranks only")
        return None
    for what, k in (("dtypes", 2), ("kinds", 1)):
        if len({row[k] for row in rows}) != 1:
            raise bad(f"have different {what} on different ranks")
    size = tuple(rows[0][6][0])
    if any(tuple(row[6][0]) != size for row in rows):
        raise bad("declare different global shapes on different ranks")
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(tuple(row[6][1]), []).append(r)
    placed = []
    for offsets, holders in sorted(groups.items()):
        if len({(tuple(rows[r][3]), rows[r][5]) for r in holders}) != 1:
            raise bad(f"at offsets {list(offsets)} differ between ranks {holders[0]} and {holders[1]} (a shard held "
                      "by several ranks must be equal on all of them)")
        owner = min(holders, key=lambda r: (load[r], r))
        load[owner] += rows[owner][4]
        placed.append(Placed(offsets, tuple(rows[owner][3]), owner, tuple(holders), rows[owner][4]))
    problem = cover_problem(size, [(p.offsets, p.sizes) for p in placed])
    if problem:
        raise bad(f"do not tile its global shape {list(size)}: {problem}")
    return placed

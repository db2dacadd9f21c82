"""The ``ranks`` member of a collective checkpoint's manifest (docs/format.md §10.5): the world size that saved it,
the key paths kept per rank, and the global layout of sharded tensors. Written by luopan.checkpoint.distributed.collective;
checked here in full before a reader sizes a buffer by it (a damaged layout is a CorruptManifestError)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import CorruptManifestError, UsageError
from ...format.limits import MAX_NDIM
from ...format.manifest import Manifest

_MAX_DIM = 2**48  # as the manifest schema bounds dimensions and offsets
_MAX_WORLD = 2**24


@dataclass(frozen=True)
class Chunk:
    """One stored shard: where it lies in the global tensor, its entry, and the ranks that held it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Sharded:
    """A tensor saved as shards: its global shape and the chunks that tile it."""

    path: str
    kind: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    def of_rank(self, rank: int) -> Chunk:
        """The chunk ``rank`` held (every rank of the saving world held exactly one: checked on parse)."""
        return next(c for c in self.chunks if rank in c.ranks)

    def at(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Chunk | None:
        return next((c for c in self.chunks if c.offsets == offsets and c.sizes == sizes), None)


def region(c: Chunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))


def byte_span(c: Chunk, shape: tuple[int, ...], size: int) -> tuple[int, int] | None:
    """(start, length) in bytes of chunk ``c`` within a C-order tensor of ``shape`` when it is one run of bytes
    (rows of a row-sharded tensor), else None."""
    if not math.prod(c.sizes):
        return 0, 0
    k = next((j for j, s in enumerate(c.sizes) if s > 1), len(c.sizes))
    if any(c.offsets[j] or c.sizes[j] != shape[j] for j in range(k + 1, len(shape))):
        return None
    start = 0
    for o, n in zip(c.offsets, shape):
        start = start * n + o
    return start * size, math.prod(c.sizes) * size


@dataclass(frozen=True)
class Ranks:
    """A manifest's ``ranks`` member, checked (world 0 and nothing else for a checkpoint saved by one process)."""

    world: int = 0
    per_rank: frozenset[str] = frozenset()
    sharded: dict[str, Sharded] = field(default_factory=dict)


def ranks_member(world: int, per_rank: list[str],
                 sharded: dict[str, tuple[str, Any, list[tuple[Any, Any, int, Any]]]]) -> dict[str, Any] | None:
    """The member for a collective save: ``sharded`` maps a path to (dtype, global size, [(offsets, sizes, entry,
    ranks)])."""
    if not per_rank and not sharded:
        return None
    out: dict[str, Any] = {"world": world, "per_rank": list(per_rank)}
    if sharded:
        out["sharded"] = {path: {"dtype": dtype, "size": list(size),
                                 "chunks": [[list(o), list(s), e, list(r)] for o, s, e, r in chunks]}
                          for path, (dtype, size, chunks) in sharded.items()}
    return out


MAX_OVERLAP_CHECKS = 10_000_000


def cover_problem(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why ``boxes`` ((offsets, sizes) each) do not tile a tensor of shape ``size`` exactly, or None when they do:
    each inside it, none overlapping, together holding every element."""
    for o, s in boxes:
        if any(a + n > m for a, n, m in zip(o, s, size)):
            return f"the shard at offsets {list(o)} of shape {list(s)} lies outside it"
    held, total = sum(math.prod(s) for _o, s in boxes), math.prod(size)
    if held != total:
        return f"its shards hold {held} of its {total} elements"
    full = [(o, s) for o, s in boxes if math.prod(s)]
    if not size or len(full) < 2:
        return None
    # sweep along the dimension with the most distinct offsets: few shards are open at once (rows, columns, grids)
    d = max(range(len(size)), key=lambda k: len({o[k] for o, _s in full}))
    full.sort(key=lambda b: b[0][d])
    open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    budget = MAX_OVERLAP_CHECKS  # a hostile layout (every box open at once) must not stall a reader for hours
    for o, s in full:
        open_ = [(a, n) for a, n in open_ if a[d] + n[d] > o[d]]
        budget -= len(open_)
        if budget < 0:
            return (f"its {len(full)} shards overlap along every dimension too much to check (more than "
                    f"{MAX_OVERLAP_CHECKS} comparisons); luopan writes no such layout")
        for a, n in open_:
            if all(x < y + m and y < x + k for x, k, y, m in zip(a, n, o, s)):
                return f"the shards at offsets {list(a)} and {list(o)} overlap"
        open_.append((o, s))
    return None


def check_member(doc: dict[str, Any], entries: list[dict[str, Any]]) -> None:
    """The reader's check of a member about to be committed: never commit a layout readers would refuse."""
    try:
        _parse(doc, entries)
    except (_Bad, KeyError, TypeError, ValueError, IndexError) as exc:
        raise UsageError(f"the ranks' shards do not form a layout luopan can read back ({exc}); nothing was "
                         "committed") from None


def parse_ranks(m: Manifest) -> Ranks:
    """The checked ``ranks`` member of ``m`` (an empty Ranks when it has none)."""
    doc = m.doc.get("ranks")
    if doc is None:
        return Ranks()
    where = f"manifest run {m.run!r} step {m.step}"
    try:
        return _parse(doc, m.entries)
    except _Bad as exc:
        raise CorruptManifestError(f"{where}: its ranks member is damaged: {exc}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptManifestError(f"{where}: its ranks member is damaged ({type(exc).__name__}: "
                                   f"{str(exc)[:200]})") from None


class _Bad(Exception):
    pass


def _int(v: Any, low: int, high: int, what: str) -> int:
    if type(v) is not int or not low <= v <= high:
        raise _Bad(f"{what} is {str(v)[:40]}")
    return v


def _ints(v: Any, what: str, high: int = _MAX_DIM, most: int = MAX_NDIM) -> tuple[int, ...]:
    if type(v) is not list or len(v) > most:
        raise _Bad(f"{what} is not a list of at most {most} integers")
    return tuple(_int(x, 0, high, what) for x in v)


def _parse(doc: Any, entries: list[dict[str, Any]]) -> Ranks:
    if type(doc) is not dict:
        raise _Bad("it is not an object")
    world = _int(doc["world"], 1, _MAX_WORLD, "world")
    per_rank = doc.get("per_rank", [])
    if type(per_rank) is not list or not all(type(p) is str for p in per_rank):
        raise _Bad("per_rank is not a list of key paths")
    raw = doc.get("sharded", {})
    if type(raw) is not dict:
        raise _Bad("sharded is not an object")
    return Ranks(world, frozenset(per_rank), _layouts(raw, entries, world))


def parse_layouts(raw: dict[str, Any], entries: list[dict[str, Any]], where: str) -> dict[str, Sharded]:
    """Checked layouts ``{path: {"dtype", "size", "chunks": [[offsets, sizes, entry, []], ...]}}`` of tensors no
    rank is recorded for (a DCP checkpoint's, luopan.checkpoint.distributed.dcpview): the checks of ``sharded``
    but the ranks'. A damaged layout is a CorruptManifestError naming ``where``."""
    try:
        return _layouts(raw, entries, None)
    except _Bad as exc:
        raise CorruptManifestError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptManifestError(f"{where} ({type(exc).__name__}: {str(exc)[:200]})") from None


def _layouts(raw: dict[str, Any], entries: list[dict[str, Any]], world: int | None) -> dict[str, Sharded]:
    """The sharded tensors of ``raw``; with ``world``, every rank 0…world-1 must have held one chunk of each."""
    sharded: dict[str, Sharded] = {}
    used: set[int] = set()
    for path, rec in raw.items():
        if type(rec) is not dict or type(rec.get("dtype")) is not str or type(rec.get("chunks")) is not list:
            raise _Bad(f"{path!r} needs a dtype, a size and chunks")
        size = _ints(rec["size"], f"the size of {path!r}")
        chunks, kinds, holders = [], set(), []
        for c in rec["chunks"]:
            if type(c) is not list or len(c) != 4:
                raise _Bad(f"a chunk of {path!r} is not [offsets, sizes, entry, ranks]")
            offsets, sizes = _ints(c[0], f"offsets of {path!r}"), _ints(c[1], f"sizes of {path!r}")
            entry = _int(c[2], 0, len(entries) - 1, f"an entry of {path!r}")
            if world is None:
                ranks = _ints(c[3], f"ranks of {path!r}", 0, 0)  # none recorded
            else:
                ranks = _ints(c[3], f"ranks of {path!r}", world - 1, world)  # a replicated shard: up to every rank
            e = entries[entry]
            if not len(offsets) == len(sizes) == len(size):
                raise _Bad(f"a chunk of {path!r} has {len(offsets)} offsets and {len(sizes)} sizes for "
                           f"{len(size)} dimensions")
            if "alias_of" in e or list(sizes) != list(e["shape"]) or e["dtype"] != rec["dtype"]:
                raise _Bad(f"the chunk of {path!r} at {list(offsets)} is not its entry's shape and dtype")
            if entry in used:
                raise _Bad(f"entry {entry} is a chunk twice")
            used.add(entry)
            kinds.add(e["kind"])
            holders += ranks
            chunks.append(Chunk(offsets, sizes, entry, ranks))
        if len(kinds) != 1:
            raise _Bad(f"{path!r} has no chunks, or chunks of several kinds")
        if world is not None and (len(holders) != world or sorted(holders) != list(range(world))):
            raise _Bad(f"the chunks of {path!r} do not name each of the {world} ranks once")
        problem = cover_problem(size, [(c.offsets, c.sizes) for c in chunks])
        if problem:
            raise _Bad(f"{path!r} of size {list(size)}: {problem}")
        sharded[path] = Sharded(path, kinds.pop(), rec["dtype"], size, tuple(chunks))
    return sharded

"""Collective saves under torch.distributed (docs/format.md §10.5): ``repo.save(run, step, state, group=…)``, called
by every rank of the group, is one checkpoint.

1. Every rank flattens its state and shares, per tensor, its key path, dtype, shape and XXH3-128 digest.
2. A tensor equal on every rank (DDP) is written once in total: by one rank, chosen to spread the bytes evenly. A
   tensor that differs between ranks (each rank's RNG state) is written by every rank and kept per rank: its node in
   the tree becomes ``{"rank-0": …, "rank-1": …}`` and the manifest's ``ranks`` member names it.
3. Each rank stores its chunks (packs, then an index file, durable); rank 0 commits one manifest once every rank
   reported success, then tells every rank the outcome. A rank that raised makes every rank raise (naming it); a
   rank that died makes the others' collectives fail at the group's timeout — never a hang, never a checkpoint.
"""

from __future__ import annotations

from typing import Any

import xxhash

from .. import typed
from ..errors import CollectiveError, UsageError
from ..format.canonical import canonical
from ..format.names import check_run, check_step, join_path, manifest_key
from ..tree import flatten, unflatten
from .info import CheckpointInfo
from .parts import WRITTEN, Parts

RANK_PREFIX = "rank-"


def _dist() -> Any:
    import torch.distributed as dist  # only collective saves need torch.distributed

    return dist


class Collective(Parts):
    """``save``/``load`` with ``group=`` (part of luopan.Repo)."""

    def save(self, run: str, step: int, state: Any, *, group: Any = None, **options: Any) -> CheckpointInfo:
        """``Repo.save``; with ``group`` (a process group, or True for the default one) every rank of the group
        calls it with its own state and one checkpoint is committed (module docstring). Without it, a save is this
        process's alone (``if rank == 0: repo.save(...)`` never waits for other ranks)."""
        if group is None or group is False:
            return super().save(run, step, state, **options)
        bad = sorted(set(options) - {"metrics", "metadata", "overwrite", "inputs"})
        if bad:
            raise UsageError(f"a collective save does not take {', '.join(bad)}")
        return _save_collective(self, run, step, state, _group(group), **options)

    def load(self, run: str, step: int | None = None, *, group: Any = None) -> Any:
        """``Repo.load``; with ``group``, each rank gets its own value of per-rank entries (``{"rank-0": …}`` nodes
        of a collective checkpoint) and reads only those of its rank; without it, all of them."""
        if group is None or group is False:
            return super().load(run, step)
        dist = _dist()
        g = _group(group)
        rank = dist.get_rank(g)
        if step is None:  # rank 0 resolves "latest" for all: a commit between two ranks' reads cannot mix steps
            chosen = [self.steps(run)[-1] if rank == 0 and self.steps(run) else None]
            dist.broadcast_object_list(chosen, src=dist.get_global_rank(g, 0), group=g)
            step = chosen[0]
        m = self.manifest(run, step)
        ranks = m.doc.get("ranks", {})
        per_rank = set(ranks.get("per_rank", []))
        if per_rank and rank >= int(ranks.get("world", 0)):
            raise UsageError(f"run {run!r} step {m.step} was saved by {ranks.get('world')} ranks and keeps per-rank "
                             f"values; rank {rank} has none: load it with at most that many ranks, or without group")
        tree = _own_rank(m.tree, "", per_rank, rank)
        return unflatten(tree, lambda i: self.load_entry(m, i), f"run {run!r} step {m.step}")


def _group(group: Any) -> Any:
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("group= needs torch.distributed initialised (dist.init_process_group) on every rank")
    return dist.group.WORLD if group is True else group


def _own_rank(node: dict[str, Any], path: str, per_rank: set[str], rank: int) -> dict[str, Any]:
    (tag, value), = node.items()
    if path in per_rank and tag == "dict":
        return dict(value)[f"{RANK_PREFIX}{rank}"]
    if tag == "dict":
        return {"dict": [[k, _own_rank(v, join_path(path, k), per_rank, rank)] for k, v in value]}
    if tag in ("list", "tuple"):
        return {tag: [_own_rank(v, join_path(path, i), per_rank, rank) for i, v in enumerate(value)]}
    if tag == "typed":  # a dataclass or namedtuple keeps its fields' key paths (module luopan.typed)
        spec = dict(value)
        if spec.get("type") in typed.PLAIN and isinstance(spec.get("v"), dict):
            spec["v"] = _own_rank(spec["v"], path, per_rank, rank)
        return {"typed": spec}
    return node


def _agree(dist: Any, group: Any, ok: bool, what: Any, committing: bool = False) -> list[Any]:
    """All ranks' (ok, detail); CollectiveError on every rank when any failed."""
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, (ok, what), group=group)
    except Exception as exc:  # noqa: BLE001 - a dead rank, a timeout: the group is broken
        outcome = ("rank 0 may have committed it: check with repo.steps(run)" if committing
                   else "nothing was committed")
        raise CollectiveError(f"a collective save lost contact with a rank ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); {outcome}") from None
    failed = [(r, d) for r, (o, d) in enumerate(out) if not o]
    if failed:
        shown = "; ".join(f"rank {r}: {d}" for r, d in failed[:4])
        raise CollectiveError(f"a collective save failed ({shown}); nothing was committed")
    return [d for _o, d in out]


def _save_collective(repo: Collective, run: str, step: int, state: Any, group: Any, *,
                     metrics: dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                     overwrite: bool = False, inputs: list[str] | None = None) -> CheckpointInfo:
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # 1. what every rank holds
    try:
        repo.drain()  # inside: an error of this rank's save_async reaches every rank, not only this one
        check_run(run)
        step = check_step(step)
        skeleton, leaves = flatten(state)
        mine = [(lf.path, lf.kind, lf.dtype, list(lf.shape), lf.nbytes, xxhash.xxh3_128_hexdigest(lf.host_bytes())
                 if lf.alias_of is None else f"alias:{lf.alias_of}") for lf in leaves]
        shape = canonical(skeleton).decode()
        report: Any = (mine, shape)
        ok, detail = True, report
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    everyone = _agree(dist, group, ok, detail)
    if any(shape != everyone[0][1] for _m, shape in everyone):
        raise CollectiveError("the ranks' states differ in structure or in non-tensor values; keep per-rank values "
                              "in tensors (they are stored per rank), or save each rank's state to its own run")
    # 2. who writes what
    load = [0] * world
    owner: dict[str, int] = {}
    per_rank: list[str] = []
    for i, row in enumerate(everyone[0][0]):
        path, digests = row[0], {(m[i][1], m[i][2], tuple(m[i][3]), m[i][5]) for m, _s in everyone}
        if len(digests) == 1:
            r = min(range(world), key=lambda k: (load[k], k))
            owner[path] = r
            load[r] += row[4]
        else:
            per_rank.append(path)
    try:
        own = [(lf.path, lf.obj) for lf in leaves if lf.alias_of is None and owner.get(lf.path) == rank]
        own += [(join_path(lf.path, f"{RANK_PREFIX}{rank}"), lf.obj) for lf in leaves
                if lf.alias_of is None and lf.path in per_rank]
        stored = repo.store_entries(own) if own else None
        ok, detail = True, (stored.entries if stored else [], stored.written if stored else {})
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    parts = _agree(dist, group, ok, detail)
    # 3. rank 0 commits, then every rank learns the outcome
    info: CheckpointInfo | None = None
    try:
        if rank == 0:
            entries, index = [], {}
            written = {k: sum(w.get(k, 0) for _e, w in parts) for k in WRITTEN}
            for rank_entries, _w in parts:
                for e in rank_entries:
                    index[e["path"]] = len(entries)
                    entries.append(e)
            tree = _tree(skeleton, leaves, index, set(per_rank), world)
            info = repo.commit_entries(run, step, entries, tree, metrics=metrics, metadata=metadata,
                                       overwrite=overwrite, written=written, inputs=inputs,
                                       extra={"ranks": {"world": world, "per_rank": per_rank}} if per_rank else None)
        ok, detail = True, None
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    _agree(dist, group, ok, detail, committing=True)
    return info if info is not None else CheckpointInfo.from_manifest(repo.manifest(run, step),
                                                                      manifest_key(run, step))


def _tree(skeleton: dict[str, Any], leaves: list[Any], index: dict[str, int], per_rank: set[str],
          world: int) -> dict[str, Any]:
    """Rank 0's skeleton with entry nodes pointing at the committed entries (per-rank ones as rank dicts)."""
    def node(n: dict[str, Any]) -> dict[str, Any]:
        (tag, value), = n.items()
        if tag == "entry":
            leaf = leaves[value]
            if leaf.alias_of is not None:
                return node({"entry": leaf.alias_of})
            if leaf.path in per_rank:
                return {"dict": [[f"{RANK_PREFIX}{r}", {"entry": index[join_path(leaf.path, f"{RANK_PREFIX}{r}")]}]
                                 for r in range(world)]}
            return {"entry": index[leaf.path]}
        if tag == "dict":
            return {"dict": [[k, node(v)] for k, v in value]}
        if tag in ("list", "tuple"):
            return {tag: [node(v) for v in value]}
        if tag == "typed":  # a dataclass or set may hold entries too
            spec = dict(value)
            if spec.get("type") in typed.PLAIN and isinstance(spec.get("v"), dict):
                spec["v"] = node(spec["v"])
            elif spec.get("type") in ("set", "frozenset") and isinstance(spec.get("v"), list):
                spec["v"] = [node(x) for x in spec["v"]]
            return {"typed": spec}
        return n

    return node(skeleton)

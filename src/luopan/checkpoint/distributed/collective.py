"""Collective saves under torch.distributed (docs/format.md §10.5): ``repo.save(run, step, state, group=…)``, called
by every rank of the group, is one checkpoint.

1. Every rank flattens its state and shares, per tensor, its key path, dtype, shape and XXH3-128 digest, with its
   run, step, ``overwrite`` and tree structure, which must agree on every rank (else every rank raises one
   CollectiveError naming what each passed, before anything is written). Ties (one tensor at several key paths) are
   per rank: a path tied on some ranks only, or to different paths, is kept per rank, and each rank that tied it
   gets the entry of the path it is tied to (stored once, loaded back tied on that rank).
2. A tensor equal on every rank (DDP) is written once in total: by one rank, chosen to spread the bytes evenly. A
   tensor that differs between ranks (each rank's RNG state) is written by every rank and kept per rank: its node in
   the tree becomes ``{"rank-0": …, "rank-1": …}`` and the manifest's ``ranks`` member names it.
   A sharded value (``luopan.Shard``, a ``DTensor``, a ``ShardedTensor``) is stored as shards, each distinct one
   once, with its global layout in ``ranks`` (modules luopan.checkpoint.distributed.shards and .ranks).
3. Each rank stores its chunks (packs, then an index file, durable); rank 0 commits one manifest once every rank
   reported success, then tells every rank the outcome. A rank that raised makes every rank raise (naming it); a
   rank that died makes the others' collectives fail at the group's timeout — never a hang, never a checkpoint.
"""

from __future__ import annotations

import errno
import json
import socket
from typing import Any

import xxhash

from ... import typed
from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CollectiveError,
    CollectiveStorageError,
    CollectiveStorageFullError,
    StorageError,
    StorageFullError,
    ReplicationError,
    UsageError,
)
from ...format.canonical import canonical
from ...format.names import check_run, check_step, join_path, manifest_key
from ...tree import flatten
from . import load as collectiveload
from .load import RANK_PREFIX
from ..info import CheckpointInfo
from ..kind import CHECKPOINTS
from .parts import WRITTEN, Parts
from .ranks import check_member, ranks_member
from .shards import Placed, local_part, place_shards, unwrap


REMOTE_COMMIT_WAIT = 600.0  # seconds rank 0 waits for a spread collective checkpoint to be confirmed on the remote


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

    def load(self, run: str, step: int | None = None, *, group: Any = None, pieces: bool = False) -> Any:
        """``Repo.load``; with ``group`` (every rank passing the same run and step, else CollectiveError on each),
        each rank gets its own values of a collective checkpoint — per-rank entries (``{"rank-0": …}`` nodes) and
        shards (its local tensor) — and reads only those; without it, all of them: per-rank values by rank, sharded
        tensors assembled whole. A DCP checkpoint (luopan.dcp.Writer) is loaded whole, its shards assembled (with
        ``group``, on every rank: each rank's part of it is luopan.dcp.Reader's job). ``pieces=True``: the entries
        as stored instead, each shard under ``<path>/shard-<offsets>`` (one process only)."""
        if pieces:
            _no_group(group)
            return self._load_manifest(self.manifest(run, step))
        if group is None or group is False:
            m = self.manifest(run, step)
            return collectiveload.load(self, m) if _laid_out(m) else self._load_manifest(m)
        g = _group(group)
        dist = _dist()
        m = self.manifest(run, _agreed(self, "load", run, step, g))
        return collectiveload.load(self, m, dist.get_rank(g), dist.get_world_size(g))

    def load_into(self, run: str, target: Any, step: int | None = None, *, strict: bool = True,
                  group: Any = None, pieces: bool = False) -> Any:
        """``Repo.load_into``; for a collective or DCP checkpoint a target tensor at a sharded path is filled whole
        (assembled) or, with ``group``, with this rank's shard of a collective one (a plain local tensor, a
        ``luopan.Shard`` or a ``DTensor`` holding the same shard as was saved); per-rank values as ``load`` gives
        them. ``pieces=True``: the target holds the entries as stored (``<path>/shard-<offsets>`` keys)."""
        if pieces:
            _no_group(group)
            return self._load_manifest_into(self.manifest(run, step), target, strict=strict)
        if group is None or group is False:
            m = self.manifest(run, step)
            if not _laid_out(m):
                return self._load_manifest_into(m, target, strict=strict)
            return collectiveload.load_into(self, m, target, strict=strict)
        g = _group(group)
        dist = _dist()
        m = self.manifest(run, _agreed(self, "load_into", run, step, g))
        return collectiveload.load_into(self, m, target, strict=strict, rank=dist.get_rank(g),
                                        world=dist.get_world_size(g))


def _laid_out(m: Any) -> bool:
    """Whether ``m`` records shard layouts or per-rank values (a collective save's ``ranks``, DCP's ``dcp``)."""
    return "ranks" in m.doc or "dcp" in m.doc


def _no_group(group: Any) -> None:
    if group is not None and group is not False:
        raise UsageError("pieces=True loads the entries as stored, in one process: drop group=")


def _group(group: Any) -> Any:
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError("group= needs torch.distributed initialised (dist.init_process_group) on every rank")
    return dist.group.WORLD if group is True else group


def _agreed(repo: Collective, op: str, run: str, step: int | None, g: Any) -> int:
    """The step every rank of ``g`` loads: all must pass the same ``run`` and ``step`` (else CollectiveError on every
    rank); for "latest" (None) the one rank 0 resolved, so a commit between two ranks' reads cannot mix steps. One
    round trip."""
    dist = _dist()
    resolved: Any = None
    if step is None and dist.get_rank(g) == 0:  # an error here reaches every rank (the others would wait)
        try:
            steps = repo.steps(run)
            resolved = ("ok", steps[-1]) if steps else ("error", repo._no_checkpoint(run))
        except Exception as exc:  # noqa: BLE001
            resolved = ("error", f"{type(exc).__name__}: {exc}")
    asked = (op, repr(run), "None (the latest)" if step is None else _shown_step(step))
    everyone = _agree(dist, g, True, (asked, resolved), what=f"a collective {op}")
    _refuse_disagreement(f"a collective {op}", [a for a, _r in everyone], "nothing was loaded")
    if step is not None:
        return step
    status, value = everyone[0][1]
    if status != "ok":
        raise CheckpointNotFoundError(f"rank 0 could not resolve the latest checkpoint of run {run!r}: {value}")
    return int(value)


def _refuse_disagreement(what: str, asked: list[tuple[Any, ...]], outcome: str) -> None:
    """CollectiveError (the same on every rank) naming each argument the ranks passed differently, and who passed
    what; ``asked`` holds each rank's (call, run, step[, overwrite]): a save meeting a load differs in the call."""
    problems = []
    for k, name in enumerate(("call", "run", "step", "overwrite")):
        groups: dict[Any, list[int]] = {}
        for r, a in enumerate(asked):
            groups.setdefault(a[k] if k < len(a) else None, []).append(r)
        if len(groups) > 1:
            verb = "called" if name == "call" else "passed"
            problems.append(f"{name}: " + ", ".join(f"{_ranks(rs)} {verb} {v}" for v, rs in list(groups.items())[:4]))
        if problems and name == "call":
            break  # the other arguments of different calls are not comparable
    if problems:
        raise CollectiveError(f"{what} failed: the ranks disagree on its arguments ({'; '.join(problems)}); every "
                              f"rank must make the same call with the same arguments; {outcome}")


def _shown_step(step: Any) -> str:
    try:
        return str(check_step(step))  # 9, np.int64(9) and tensor(9) are one step
    except Exception:  # noqa: BLE001 - an invalid step is refused once the ranks agree on it
        return repr(step)[:40]


def _ranks(rs: list[int]) -> str:
    shown = ", ".join(map(str, rs[:8])) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")
    return f"rank {shown}" if len(rs) == 1 else f"ranks {shown}"


def _agree(dist: Any, group: Any, ok: bool, detail: Any, committing: bool = False,
           what: str = "a collective save") -> list[Any]:
    """All ranks' (ok, detail); CollectiveError on every rank when any failed (a failure's detail is ``_failure``'s):
    CollectiveStorageFullError when every failed rank ran out of space, CollectiveStorageError when each met a
    store's failure, so every rank can handle it alike."""
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    saving = what == "a collective save"
    try:
        dist.all_gather_object(out, (ok, detail), group=group)
    except Exception as exc:  # noqa: BLE001 - a dead rank, a timeout: the group is broken
        outcome = ("rank 0 may have committed it: check with repo.steps(run)" if committing
                   else "nothing was committed" if saving else "nothing was loaded")
        raise CollectiveError(f"{what} lost contact with a rank ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); {outcome}") from None
    failed = [(r, d) for r, (o, d) in enumerate(out) if not o]
    if failed:
        shown = "; ".join(f"rank {r}: {d[0]}" for r, d in failed[:4])
        message = f"{what} failed ({shown}); {'nothing was committed' if saving else 'nothing was loaded'}"
        kinds = {d[1] for _r, d in failed}
        code = failed[0][1][2]
        if kinds == {"full"}:  # every rank meets the same typed error: all free space and save again together
            raise CollectiveStorageFullError(code or errno.ENOSPC, message)
        if None not in kinds:
            raise CollectiveStorageError(next(d[2] for _r, d in failed if d[1] == "storage") or code or errno.EIO,
                                         message)
        raise CollectiveError(message)
    return [d for _o, d in out]


def _gather_to_first(dist: Any, group: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj`` at the group's rank 0 (a list there, [] elsewhere); CollectiveError naming the lost contact
    when the group breaks (nothing was committed: rank 0 commits after it)."""
    first = dist.get_rank(group) == 0
    out: list[Any] = [None] * dist.get_world_size(group) if first else []
    try:
        dist.gather_object(obj, out if first else None, group=group, group_dst=0)
    except Exception as exc:  # noqa: BLE001 - a dead rank, a timeout: the group is broken
        raise CollectiveError(f"a collective save lost contact with a rank ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); nothing was committed") from None
    return out


def _failure(exc: Exception) -> tuple[str, str | None, int | None]:
    """What a rank reports of its failure: the text, whether it is a store's failure ("full", "storage" or None),
    and its errno."""
    kind = "full" if isinstance(exc, StorageFullError) else "storage" if isinstance(exc, StorageError) else None
    return f"{type(exc).__name__}: {exc}", kind, exc.errno if kind else None


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
        state, declared = unwrap(state)  # sharded values -> their local tensors, and where those lie
        skeleton, leaves = flatten(state)
        hidden = [lf.path for lf in leaves if local_part(lf.obj) is not None]
        if hidden:
            raise UsageError(f"a sharded value inside a dataclass, namedtuple or set ({hidden[0]!r}): keep DTensors "
                             "and shards in dicts, lists and tuples")
        mine = [(lf.path, lf.kind, lf.dtype, list(lf.shape), lf.nbytes, xxhash.xxh3_128_hexdigest(lf.host_bytes())
                 if lf.alias_of is None else f"alias:{lf.alias_of}", _layout(declared.get(id(lf.obj))))
                for lf in leaves]
        shape = canonical(skeleton).decode()
        ok, detail = True, (("save", repr(run), str(step), bool(overwrite)), (mine, shape, _place(repo)))
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        ok, detail = False, _failure(exc)
    everyone = _agree(dist, group, ok, detail)  # the one round trip that also checks the ranks agree
    _refuse_disagreement("a collective save", [h for h, _r in everyone], "nothing was committed")
    reports = [r for _h, r in everyone]
    problem = _structure_problem([r[1] for r in reports])
    # ranks whose local tiers differ (one per node) meet only on the remote: parts go there before rank 0 commits
    places = {r[2] for r in reports}
    spread = None not in places and len(places) > 1
    if problem:
        raise CollectiveError(f"a collective save failed: the ranks' states differ in structure or in non-tensor "
                              f"values ({problem}); keep per-rank values in tensors (they are stored per rank), or "
                              "save each rank's state to its own run; nothing was committed")
    # 2. who writes what
    load = [0] * world
    owner: dict[str, int] = {}
    per_rank: dict[str, list[int | None]] = {}  # path -> per rank, the leaf its value is tied to (None: its own)
    sharded: dict[str, list[Placed]] = {}
    for i, row in enumerate(reports[0][0]):
        rows = [r[0][i] for r in reports]
        if any(r[6] is not None for r in rows):  # a sharded tensor: each distinct shard once
            placed = place_shards(row[0], rows, load)
            if placed is not None:
                sharded[row[0]] = placed
            continue
        path, digests = row[0], {(r[1], r[2], tuple(r[3]), r[5]) for r in rows}
        if len(digests) == 1:
            if not row[5].startswith("alias:"):  # tied alike on every rank: stored with what it is tied to
                r = min(range(world), key=lambda k: (load[k], k))
                owner[path] = r
                load[r] += row[4]
        else:  # differs between ranks, or is tied on some ranks only (or to other paths): ties are per rank
            per_rank[path] = [int(r[5][6:]) if r[5].startswith("alias:") else None for r in rows]
    try:
        own = [(lf.path, lf.obj) for lf in leaves if lf.alias_of is None and owner.get(lf.path) == rank]
        own += [(join_path(lf.path, f"{RANK_PREFIX}{rank}"), lf.obj) for lf in leaves
                if lf.alias_of is None and lf.path in per_rank]
        own += [(join_path(lf.path, p.name), lf.obj) for lf in leaves if lf.alias_of is None
                for p in sharded.get(lf.path, ()) if p.owner == rank]
        stored = repo.store_entries(own) if own else None
        if spread and stored is not None:  # durable on the remote before this rank reports (§10.5)
            repo.tier.publish(stored.packs, [stored.index_key] if stored.index_key else [])
        ok, detail = True, (stored.entries if stored else [], stored.written if stored else {})
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, _failure(exc)
    # Every rank learns whether every part is stored (a small exchange); only rank 0, which commits, receives the
    # parts' entries: an all-gather of them would send every rank's chunk rows to every rank (world^2 bytes).
    _agree(dist, group, ok, None if ok else detail)
    parts = _gather_to_first(dist, group, detail)
    # 3. rank 0 commits, then every rank learns the outcome
    info: CheckpointInfo | None = None
    try:
        if rank == 0:
            entries, index = [], {}
            written = {k: sum(w.get(k, 0) for _e, w in parts) for k in WRITTEN}
            for rank_entries, _w in parts:  # (entries, written) of each rank, gathered here only
                for e in rank_entries:
                    index[e["path"]] = len(entries)
                    entries.append(e)
            tree = _tree(skeleton, leaves, index, per_rank, sharded)
            rows = {row[0]: row for row in reports[0][0]}
            member = ranks_member(world, list(per_rank), {
                path: (rows[path][2], rows[path][6][0],
                       [(p.offsets, p.sizes, index[join_path(path, p.name)], p.ranks) for p in placed])
                for path, placed in sharded.items()})
            if member:
                check_member(member, entries)
            key = manifest_key(run, step)
            if spread:  # every rank put its packs on the remote, verified, before it reported
                repo.tier.vouch(list(dict.fromkeys(r[1] for e in entries for r in e["chunks"])))
            if spread and not overwrite and repo.tier.remote.exists(key):  # saved from another node's local tier
                raise CheckpointExistsError(f"run {run!r} already has a checkpoint at step {step} on the remote "
                                            f"{repo.tier.remote.describe()}; pass overwrite=True to replace it")
            info = repo.commit_entries(run, step, entries, tree, metrics=metrics, metadata=metadata,
                                       overwrite=overwrite, written=written, inputs=inputs,
                                       extra={"ranks": member} if member else None)
            if spread and not repo.tier.wait_for(CHECKPOINTS, run, step, REMOTE_COMMIT_WAIT):
                raise ReplicationError(f"run {run!r} step {step} is committed on rank 0's local tier but did not "
                                       f"reach the remote {repo.tier.remote.describe()} within {REMOTE_COMMIT_WAIT:.0f}"
                                       " s; the other ranks can load it once it does (repo.tier.wait() on rank 0)")
        ok, detail = True, None
    except Exception as exc:  # noqa: BLE001
        ok, detail = False, _failure(exc)
    _agree(dist, group, ok, detail, committing=True)
    return info if info is not None else CheckpointInfo.from_manifest(repo.manifest(run, step),
                                                                      manifest_key(run, step))


def _place(repo: Collective) -> str | None:
    """Where this rank's local tier lies (host and directory) when its repository is tiered; None when it is not.
    Ranks whose places differ share only the remote."""
    tier = repo.tier
    if tier is None or getattr(tier, "remote", None) is None:
        return None
    return f"{socket.gethostname()}:{tier.local.describe()}"


def _structure_problem(shapes: list[str]) -> str | None:
    """Where the first rank whose skeleton (canonical JSON) differs from rank 0's differs, and what each has there."""
    for r, shape in enumerate(shapes):
        if shape != shapes[0]:
            path, mine, theirs = _first_difference(json.loads(shapes[0]), json.loads(shape), "") or ("", "?", "?")
            return f"at key path {path or '<root>'!r} rank 0 has {mine}, rank {r} has {theirs}"
    return None


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, str, str] | None:
    (ta, va), = a.items()
    (tb, vb), = b.items()
    if ta != tb or ta not in ("dict", "list", "tuple"):
        return None if a == b else (path, _describe(a), _describe(b))
    if ta == "dict":
        da, db = dict((k, v) for k, v in va), dict((k, v) for k, v in vb)
        for k in [k for k, _v in va] + [k for k, _v in vb if k not in da]:
            if k not in da or k not in db:
                return (join_path(path, k), _describe(da[k]) if k in da else "nothing",
                        _describe(db[k]) if k in db else "nothing")
            found = _first_difference(da[k], db[k], join_path(path, k))
            if found:
                return found
        return None if [k for k, _v in va] == [k for k, _v in vb] else (path, "other key order", "other key order")
    if len(va) != len(vb):
        return path, _describe(a), _describe(b)
    return next((d for i, (x, y) in enumerate(zip(va, vb)) if (d := _first_difference(x, y, join_path(path, i)))),
                None)


def _describe(n: Any) -> str:
    (tag, value), = n.items()
    if tag == "entry":
        return "a tensor"
    if tag in ("dict", "list", "tuple"):
        return f"a {tag} of {len(value)}"
    if tag == "typed":
        return f"a {value.get('type')} value" if isinstance(value, dict) else "a typed value"
    return "None" if tag == "none" else f"{tag} {value!r}"[:80]


def _layout(layout: Any) -> list[list[int]] | None:
    return None if layout is None else [list(layout[0]), list(layout[1])]


def _tree(skeleton: dict[str, Any], leaves: list[Any], index: dict[str, int], per_rank: dict[str, list[int | None]],
          sharded: dict[str, list[Placed]]) -> dict[str, Any]:
    """Rank 0's skeleton with entry nodes pointing at the committed entries (per-rank ones as rank dicts, sharded ones
    as dicts of their shards). A rank whose value at a per-rank path is tied to another path's gets that path's entry
    for this rank there (stored once, loaded back tied on that rank only)."""
    def stored(path: str, r: int) -> dict[str, Any]:
        return {"entry": index[join_path(path, f"{RANK_PREFIX}{r}") if path in per_rank else path]}

    def node(n: dict[str, Any]) -> dict[str, Any]:
        (tag, value), = n.items()
        if tag == "entry":
            leaf = leaves[value]
            if leaf.path in per_rank:  # before rank 0's own tie: ties are per rank
                return {"dict": [[f"{RANK_PREFIX}{r}", stored(leaf.path if k is None else leaves[k].path, r)]
                                 for r, k in enumerate(per_rank[leaf.path])]}
            if leaf.alias_of is not None:
                return node({"entry": leaf.alias_of})
            if leaf.path in sharded:
                return {"dict": [[p.name, {"entry": index[join_path(leaf.path, p.name)]}] for p in sharded[leaf.path]]}
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

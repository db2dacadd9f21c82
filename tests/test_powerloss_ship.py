"""Power loss during the operations that ship state (tests/powerloss.py, docs/format.md §10.6): a collective save
(one rank in this process, and two ranks in two processes), an artifact commit, ``publish`` of a channel, and the
output files of ``pull`` and ``patch apply``.

Each test records one operation's file operations and checks the crash states the durability model allows (up to
``LUOPAN_POWERLOSS_STATES`` per operation). In each state: the repository (or channel, or device directory) opens
or is as it was before; every object committed before the operation reads back bit for bit; the object in flight is
wholly there or wholly absent, and there once the operation returned; an output file holds its old bytes or the
whole new file, never a part; and the operation, run again on the crashed state, succeeds.

The two-rank collective save: a ``Recorder`` sees only its own process, so each rank records its own part and the
parts are merged into one record (``merge_segments``). The ranks take turns: the patched ``store_entries`` lets
rank 0 store its chunks, then rank 1, each under a recorder started at its turn and stopped before the next rank's
(``dist.barrier`` between turns), and rank 0 commits under a last recorder. That is one schedule the protocol allows
(every rank's chunks are durable before it reports success, and rank 0 commits only once every rank reported, by
``all_gather``), and with the turns serialized the merged record is exactly what one recorder watching the whole
machine would have recorded: each segment's starting tree is checked to be the tree the segments before it left,
and the final tree on disk to be the merged record's. Other interleavings of the ranks' writes are not tried: they
differ only in when one rank's directory syncs happen to cover another rank's entries, which the protocol does not
rely on (each rank syncs what it wrote before it reports success; dropping rank 1's pack syncs from the merged
record is checked to lose the checkpoint in some crash state). A rank killed before the commit is
tests/test_collective.py::test_a_rank_killed_mid_collective_save_leaves_no_checkpoint. The retry in the two-rank
test is a plain save of the same tree by the test's process (a collective one would take two processes per state);
the one-rank test retries the collective save itself.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import blake3
import numpy as np
import pytest
import torch

import luopan
import luopan.patch
from luopan.channel import parse_index, publish, pull, read_state
from luopan.signing import TrustedKeys, generate_key, load_signing_key

from .crashstates import CrashState, check_crash_states
from .helpers import assert_exact
from .powerloss import BlindSpot, Event, Recorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 16 << 10


def open_repo(path, **kw):
    return luopan.open(path, chunk_size=CHUNK, pack_size=64 << 10, progress=False, **kw)


def record(world, op):
    with Recorder(world) as rec:
        op(rec)
    return rec


def tree_files(root, dirs=False):
    """{relative path: bytes} of every file under ``root``; with ``dirs``, directories too (as None)."""
    out = {}
    for top, subdirs, files in os.walk(root):
        for d in subdirs if dirs else ():
            out[os.path.relpath(os.path.join(top, d), root)] = None
        for f in files:
            path = os.path.join(top, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = fh.read()
    return out


# -- a collective save ----------------------------------------------------------------------------------------------
def rank_state(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step``: two replicated tensors (each stored by one rank, 128 KiB: several chunks
    and packs) and a per-rank one."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(128, 256, generator=g), "v": torch.randn(128, 256, generator=g)},
            "rng": torch.full((4,), float(rank * 100 + step)), "step": step}


def whole_state(world: int, step: int) -> dict:
    """What one process loads back from the collective save of ``rank_state`` at ``step`` by ``world`` ranks."""
    s = rank_state(0, step)
    if world > 1:
        s["rng"] = {f"rank-{r}": rank_state(r, step)["rng"] for r in range(world)}
    return s


def steps_of(repo, run):
    try:
        return set(repo.steps(run))
    except luopan.LuopanError:
        return set()


class Saved:
    """In every crash state: the repository opens; every (run, step) of ``before`` loads exactly; ``inflight`` is
    there (loading exactly) or absent, and there once ("done", key) was acknowledged; ``retry(repo, key)`` then
    saves an absent ``inflight`` checkpoint again, which must load exactly (in every ``retry_every``-th state where
    it is absent: a save costs)."""

    def __init__(self, before, inflight, retry, retry_every=1):
        self.before, self.inflight, self.retry, self.retry_every = before, inflight, retry, retry_every
        self.absent = self.retried = 0

    def __call__(self, state: CrashState) -> None:
        r = open_repo(os.path.join(state.root, "repo"))
        try:
            runs = {run for run, _ in (*self.before, *self.inflight)}
            listed = {(run, s) for run in runs for s in steps_of(r, run)}
            for key, want in self.before.items():
                assert key in listed, f"{key} was committed before the operation and is gone"
                assert_exact(r.load(key[0], key[1]), want)
            for key, want in self.inflight.items():
                if ("done", key) in state.acks:
                    assert key in listed, f"{key} was acknowledged and is gone"
                if key in listed:
                    assert_exact(r.load(key[0], key[1]), want)
                    continue
                self.absent += 1
                if self.retry is not None and self.absent % self.retry_every == 1 % self.retry_every:
                    self.retry(r, key)  # the operation again, on the crashed repository
                    assert_exact(r.load(key[0], key[1]), want)
                    self.retried += 1
        finally:
            r.close()


@pytest.fixture
def one_rank_group(tmp_path):
    """torch.distributed initialised in this process as a gloo group of one rank (a FileStore outside the world)."""
    import torch.distributed as dist

    if dist.is_initialized():  # left by another test in this process
        assert dist.get_world_size() == 1, (
            f"another test left torch.distributed initialised with {dist.get_world_size()} ranks in this process: "
            "it must destroy its process group")
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collective_save_of_one_rank(tmp_path, one_rank_group):
    """``save(..., group=...)`` of a group of one rank, in this process: the whole collective path (agreement,
    ``store_entries``, rank 0's ``commit_entries``) with every file operation recorded."""
    world = tmp_path / "w"
    s1, s2 = rank_state(0, 1), rank_state(0, 2)
    r = open_repo(world / "repo")
    r.save("run", 1, s1, group=one_rank_group)
    r.close()

    def op(rec):
        r = open_repo(world / "repo")
        r.save("run", 2, s2, group=one_rank_group, metrics={"loss": 0.5})
        rec.ack(("done", ("run", 2)))
        r.close()

    rec = record(world, op)
    check = Saved({("run", 1): whole_state(1, 1)}, {("run", 2): whole_state(1, 2)},
                  lambda r, key: r.save(key[0], key[1], s2, group=one_rank_group), retry_every=2)
    assert check_crash_states(rec, tmp_path, check) > 20
    assert check.retried > 0


# The two-rank collective save: this module is also the rank's program (python -m tests.test_powerloss_ship ...).
def dump_recorder(rec: Recorder) -> dict:
    def b64(data):
        return None if data is None else base64.b64encode(data).decode()

    return {"base_names": rec.base_names, "base_content": {str(o): b64(c) for o, c in rec.base_content.items()},
            "base_dirs": sorted(rec.base_dirs),
            "events": [{"kind": e.kind, "path": e.path, "dst": e.dst, "oid": e.oid, "data": b64(e.data)}
                       for e in rec.events if e.kind != "ack"]}


def rank_main(rank: int, world_size: int, repo_path: str, world: str, rendezvous: str, out: str) -> None:
    """One rank: a collective save of step 2 whose ``store_entries`` (every rank, in turn) and ``commit_entries``
    (rank 0) each run under a Recorder of ``world``; the records go to ``out`` as JSON."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    segments = []
    repo = luopan.open(repo_path, progress=False)

    def recorded(turn, fn, *args, **kw):
        rec = Recorder(world)
        rec.start()
        try:
            return fn(*args, **kw)
        finally:
            rec.stop()  # checks the mirror: nobody else writes during this turn
            segments.append({"turn": turn, **dump_recorder(rec)})

    kind = repo.checkpointing  # the checkpoint kind: a collective save calls its store_entries / commit_entries
    store, commit = kind.store_entries, kind.commit_entries

    def store_in_turn(tensors):
        got, failed = None, None
        for r in range(world_size):
            if r == rank:
                try:
                    got = recorded(r, store, tensors)
                except BaseException as exc:  # noqa: BLE001 - raised after the turns, so no rank waits forever
                    failed = exc
            dist.barrier()
        if failed is not None:
            raise failed
        return got

    kind.store_entries = store_in_turn
    kind.commit_entries = lambda *a, **kw: recorded(world_size, commit, *a, **kw)
    repo.save("run", 2, rank_state(rank, 2), group=True)
    kind.store_entries, kind.commit_entries = store, commit
    dist.barrier()  # every rank returned before any closes the repository or writes its record
    repo.close()
    with open(out, "w") as f:
        json.dump(segments, f)
    dist.barrier()
    dist.destroy_process_group()


def merge_segments(segments: list[dict], label) -> SimpleNamespace:
    """One record (what ``check_crash_states`` reads: events, base_names, base_content, base_dirs) from recorders
    that ran one after another over the same world, in ``turn`` order, with the acknowledgement ``label`` at the end.
    Each recorder numbered its objects itself: its starting tree must be the tree the ones before it left (checked:
    names, kinds and bytes), and its objects are renumbered by path into the merged numbering."""
    segments = sorted(segments, key=lambda s: s["turn"])
    first = segments[0]
    names = dict(first["base_names"])  # the merged mirror: path -> oid
    content = {int(o): base64.b64decode(c) for o, c in first["base_content"].items()}
    dirs = set(first["base_dirs"])
    merged = SimpleNamespace(base_names=dict(names), base_content=dict(content), base_dirs=set(dirs), events=[])
    next_oid = max(names.values()) + 1

    def move(src, dst):
        moved = {p: o for p, o in names.items() if p == src or p.startswith(src + os.sep)}
        for p in moved:
            del names[p]
        for p in [p for p in names if p == dst or p.startswith(dst + os.sep)]:
            del names[p]
        for p, o in moved.items():
            names[dst + p[len(src):]] = o

    for seg in segments:
        base_content = {int(o): base64.b64decode(c) for o, c in seg["base_content"].items()}
        if set(seg["base_names"]) != set(names):
            raise BlindSpot(f"turn {seg['turn']} started on another tree than the turns before left: "
                            f"{sorted(set(seg['base_names']) ^ set(names))[:5]}")
        local = {}  # this recorder's oid -> merged oid
        for path, oid in seg["base_names"].items():
            local[oid] = names[path]
            if (oid in seg["base_dirs"]) != (names[path] in dirs) or \
                    (oid not in seg["base_dirs"] and base_content[oid] != content[names[path]]):
                raise BlindSpot(f"turn {seg['turn']}: {path} changed between turns without a recorder seeing it")
        for e in seg["events"]:
            kind, data = e["kind"], None if e["data"] is None else base64.b64decode(e["data"])
            if kind in ("create", "mkdir"):
                local[e["oid"]] = next_oid
                next_oid += 1
            oid = local[e["oid"]]
            if kind == "create":
                names[e["path"]], content[oid] = oid, b""
            elif kind == "mkdir":
                names[e["path"]] = oid
                dirs.add(oid)
            elif kind == "data":
                content[oid] = data
            elif kind == "rename":
                move(e["path"], e["dst"])
            elif kind == "link":
                names[e["dst"]] = oid
            elif kind in ("unlink", "rmdir"):
                names.pop(e["path"], None)
            merged.events.append(Event(kind, path=e["path"], dst=e["dst"], oid=oid, data=data))
    merged.events.append(Event("ack", label=label))
    merged.final = {p: None if o in dirs else content[o] for p, o in names.items() if p}
    return merged


def test_collective_save_of_two_ranks(tmp_path, child_env):
    """Two ranks in two processes, each recording its own part; the parts merged (module docstring)."""
    world = tmp_path / "w"
    r = open_repo(world / "repo")
    r.save("solo", 1, {"x": np.arange(3000.0)})  # committed before: a plain save
    r.close()
    env = {**child_env, "PYTHONPATH": ROOT + os.pathsep + child_env["PYTHONPATH"]}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_powerloss_ship", str(rank), "2",
                               str(world / "repo"), str(world), str(tmp_path / "rendezvous"),
                               str(tmp_path / f"rank{rank}.json")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    outcomes = [(p.wait(timeout=300), p.stderr.read().decode()[-4000:]) for p in procs]
    for code, err in outcomes:
        assert code == 0, err
    segments = [s for rank in range(2) for s in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert sorted(s["turn"] for s in segments) == [0, 1, 2]  # both ranks stored, rank 0 committed
    rec = merge_segments(segments, ("done", ("run", 2)))
    assert rec.final == tree_files(world, dirs=True), "a write escaped the recorders"
    assert all(any(e["kind"] == "fsync" for e in s["events"]) for s in segments)
    # the retry: the same tree saved by this process (a collective retry would take two processes per state)
    check = Saved({("solo", 1): {"x": np.arange(3000.0)}}, {("run", 2): whole_state(2, 2)},
                  lambda r, key: r.save(key[0], key[1], whole_state(2, 2)), retry_every=3)
    assert check_crash_states(rec, tmp_path, check) > 20
    assert check.retried > 0
    # not vacuous: had rank 1 not synced its pack files, some crash state would lose its part of the checkpoint
    for s in segments:
        if s["turn"] == 1:
            s["events"] = [e for e in s["events"] if not (e["kind"] == "fsync" and ".pack" in e["path"])]
    unsynced = merge_segments(segments, ("done", ("run", 2)))
    with pytest.raises(AssertionError, match="crash after event"):
        check_crash_states(unsynced, tmp_path, Saved({}, {("run", 2): whole_state(2, 2)}, None))


# -- an artifact commit -------------------------------------------------------------------------------------------
def artifact_files(seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {"data/part-0.bin": rng.bytes(150_000), "data/part-1.bin": rng.bytes(40_000),
            "notes.txt": b"seed %d\n" % seed, "empty": b""}


def read_version(art, version: int) -> dict[str, bytes]:
    out = {}
    for e in art.listing(version):
        if e["type"] == "file":
            with art.open(e["path"], version) as f:
                out[e["path"]] = f.read()
    return out


def test_artifact_commit(tmp_path):
    world = tmp_path / "w"
    v1 = artifact_files(1)
    v2 = {**v1, "data/part-1.bin": artifact_files(2)["data/part-1.bin"], "notes.txt": b"v2\n"}
    r = open_repo(world / "repo")
    r.artifact("ds").commit(v1)
    r.save("solo", 1, {"x": np.arange(3000.0)})
    r.close()

    def op(rec):
        r = open_repo(world / "repo")
        got = r.artifact("ds").commit(v2, parents=["ds@1"], metadata={"rows": 2})
        rec.ack(("done", got.version))
        r.close()
        assert got.version == 2

    rec = record(world, op)
    retried = []

    def check(state: CrashState) -> None:
        r = open_repo(os.path.join(state.root, "repo"))
        try:
            art = r.artifact("ds")
            numbers = art.numbers()
            assert numbers in ([1], [1, 2]), numbers
            assert read_version(art, 1) == v1
            assert_exact(r.load("solo", 1), {"x": np.arange(3000.0)})
            if ("done", 2) in state.acks:
                assert numbers == [1, 2], "version 2 was acknowledged and is gone"
            if numbers == [1, 2]:
                assert read_version(art, 2) == v2 and art.get(2).parents == ["ds@1"]
            else:  # the commit again, on the crashed repository: version 2, whole
                assert art.commit(v2, parents=["ds@1"]).version == 2
                assert read_version(art, 2) == v2
                art.verify()
                retried.append(state.point)
        finally:
            r.close()

    assert check_crash_states(rec, tmp_path, check) > 20
    assert retried


# -- publish of a channel -------------------------------------------------------------------------------------------
@pytest.fixture
def channel_env(tmp_path):
    """A signing key, the trusted public key, and a repository (outside the world: publish only reads it) holding
    three steps of run "a" whose "model" subtrees differ in one chunk from step to step."""
    generate_key(tmp_path / "keys", "release")
    (tmp_path / "trusted").mkdir()
    shutil.copy(tmp_path / "keys" / "release.pub", tmp_path / "trusted" / "release.pub")
    repo = open_repo(tmp_path / "repo")
    rng = np.random.default_rng(0)
    state = {"model": {f"w{i}": rng.standard_normal((32, 256), dtype=np.float32) for i in range(3)}}
    exports = {}
    for step in (1, 2, 3):
        if step > 1:
            state["model"][f"w{step - 1}"][:4] += 1.0
        repo.save("a", step, state)
        exports[step] = tmp_path / f"v{step}.safetensors"
        repo.export("a", exports[step], step, subtree="model")
    yield SimpleNamespace(key=load_signing_key(tmp_path / "keys" / "release.key"), trusted=tmp_path / "trusted",
                          repo=repo, exports={k: v.read_bytes() for k, v in exports.items()}, export_paths=exports)
    repo.close()


def channel_versions(chan: str, trusted) -> tuple[int, dict[int, bytes]]:
    """(index version, {version: bytes of its full file}) of the channel in ``chan``, every file the index names
    checked to be in place with its listed size and BLAKE3 and the index's signature checked."""
    data = open(os.path.join(chan, "index.json"), "rb").read()
    index = parse_index(data)
    TrustedKeys.load(trusted).verify(index.signed_bytes(), index.signature, "index")
    for ref in index.files():
        with open(os.path.join(chan, *ref.name.split("/")), "rb") as f:
            got = f.read()
        assert len(got) == ref.size and blake3.blake3(got).hexdigest() == ref.blake3, f"{ref.name} is damaged"
    fulls = {}
    for v in index.versions:
        with open(os.path.join(chan, *v.full.name.split("/")), "rb") as f:
            fulls[v.step] = f.read()
    return index.version, fulls


def test_publish(tmp_path, channel_env):
    """A second publish to a channel: in every crash state the channel's index verifies and names only files that
    are in place and intact, the version published before is listed with its exact bytes, the new one is listed
    once acknowledged, and publishing again succeeds and lists it."""
    env = channel_env
    world = tmp_path / "w"
    chan = world / "site" / "stable"
    publish(env.repo, "a", 1, chan, sign_key=env.key, subtree="model")

    def op(rec):
        publish(env.repo, "a", 2, chan, sign_key=env.key, subtree="model")
        rec.ack("published")

    rec = record(world, op)
    assert any(".publish-tmp" in e.path for e in rec.events)  # the scratch space is inside the world
    retried = []

    def check(state: CrashState) -> None:
        root = os.path.join(state.root, "site", "stable")
        version, fulls = channel_versions(root, env.trusted)
        assert version in (1, 2) and fulls[1] == env.exports[1]
        if "published" in state.acks:
            assert version == 2
        if version == 2:
            assert fulls == {1: env.exports[1], 2: env.exports[2]}
        if version == 1 or len(retried) < 10:  # publish again on the crashed channel (every state where it is due)
            publish(env.repo, "a", 2, root, sign_key=env.key, subtree="model")
            again, fulls = channel_versions(root, env.trusted)
            assert again == version + 1 and fulls[2] == env.exports[2]
            retried.append(state.point)

    assert check_crash_states(rec, tmp_path, check) > 20
    assert retried


def test_first_publish_into_a_new_channel(tmp_path, channel_env):
    """The first publish makes the channel directory: in every crash state the channel has no index (as before) or
    a verified one listing version 1, and publishing again succeeds."""
    env = channel_env
    world = tmp_path / "w"
    (world / "site").mkdir(parents=True)
    chan = world / "site" / "stable"

    def op(rec):
        publish(env.repo, "a", 1, chan, sign_key=env.key, subtree="model")
        rec.ack("published")

    rec = record(world, op)

    def check(state: CrashState) -> None:
        root = os.path.join(state.root, "site", "stable")
        if os.path.exists(os.path.join(root, "index.json")):
            version, fulls = channel_versions(root, env.trusted)
            assert version == 1 and fulls == {1: env.exports[1]}
        else:
            assert "published" not in state.acks, "the acknowledged publish is gone"
        if "published" in state.acks:  # the mark that lets a rerun replace unindexed files is gone with the index
            assert not os.path.exists(os.path.join(root, ".publish-first"))
        publish(env.repo, "a", 1, root, sign_key=env.key, subtree="model")
        _, fulls = channel_versions(root, env.trusted)
        assert fulls == {1: env.exports[1]}

    assert check_crash_states(rec, tmp_path, check) > 10


# -- patch apply and pull output files ------------------------------------------------------------------------------
def strays(directory: str, keep: set[str]) -> list[str]:
    return sorted(set(os.listdir(directory)) - keep)


def test_patch_apply_output(tmp_path, channel_env):
    """``patch apply`` over an existing output: in every crash state the output holds its old bytes or the whole
    target, never a part (the target once acknowledged), the base and the patch are untouched, and applying again
    writes the target."""
    env = channel_env
    world = tmp_path / "w"
    world.mkdir()
    patch = tmp_path / "p.lpatch"
    luopan.patch.create(env.repo, "a", 1, 3, patch, subtree="model")
    shutil.copy(env.export_paths[1], world / "base.safetensors")
    shutil.copy(env.export_paths[2], world / "out.safetensors")  # an older output, replaced by the apply
    old, new = env.exports[2], env.exports[3]

    def op(rec):
        luopan.patch.apply(patch, world / "base.safetensors", world / "out.safetensors")
        rec.ack("applied")

    rec = record(world, op)
    assert (world / "out.safetensors").read_bytes() == new

    def check(state: CrashState) -> None:
        files = tree_files(state.root)
        assert files["base.safetensors"] == env.exports[1]
        out = files.get("out.safetensors")
        assert out in (old, new), f"out.safetensors is neither the old file nor the target ({len(out or b'')} bytes)"
        if "applied" in state.acks:
            assert out == new
        luopan.patch.apply(patch, os.path.join(state.root, "base.safetensors"),
                           os.path.join(state.root, "out.safetensors"))
        assert tree_files(state.root)["out.safetensors"] == new
        extra = strays(state.root, {"base.safetensors", "out.safetensors"})
        assert all(".tmp-" in n for n in extra), extra  # at most temporary files a crash left, which break nothing

    assert check_crash_states(rec, tmp_path, check) > 20


@pytest.mark.parametrize("in_place", [False, True], ids=["to-new-file", "in-place"])
def test_pull_output(tmp_path, channel_env, in_place):
    """``pull`` from a channel directory onto a device holding version 1 (and a state file): the output is its old
    bytes (or absent, as before) or the whole newest version, never a part, the state file is absent or readable,
    and pulling again installs the newest version, whatever partial, temporary or state files the crash left."""
    env = channel_env
    chan = tmp_path / "site" / "stable"  # outside the world: pull only reads it
    for step in (1, 2, 3):
        publish(env.repo, "a", step, chan, sign_key=env.key, subtree="model")
    world = tmp_path / "w"
    world.mkdir()
    shutil.copy(env.export_paths[1], world / "model.safetensors")  # the device has version 1, no state file yet
    out_name = "model.safetensors" if in_place else "new.safetensors"
    old = env.exports[1] if in_place else None
    new = env.exports[3]

    def op(rec):
        got = pull(str(chan), world / "model.safetensors", world / out_name, trusted_keys=env.trusted,
                   state_file=world / "state.json")
        rec.ack("pulled")
        assert got["kind"] == "patch" and got["from_version"] == 1, got

    rec = record(world, op)
    assert (world / out_name).read_bytes() == new

    def check(state: CrashState) -> None:
        root = state.root
        files = tree_files(root)
        assert files.get(out_name) in (old, new), f"{out_name} is neither its old bytes nor the newest version"
        if not in_place:
            assert files["model.safetensors"] == env.exports[1]
        state_path = os.path.join(root, "state.json")
        if "pulled" in state.acks:
            assert files[out_name] == new and read_state(state_path).version == 3
        read_state(state_path)  # absent (None) or whole: never damaged
        got = pull(str(chan), os.path.join(root, "model.safetensors"), os.path.join(root, out_name),
                   trusted_keys=env.trusted, state_file=state_path)
        assert got["version"] == 3
        files = tree_files(root)
        assert files[out_name] == new and read_state(state_path).version == 3
        extra = strays(root, {"model.safetensors", out_name, "state.json"})
        # the partial download and the patch's output are removed by the retry; a temporary file of an atomic
        # replace cut short by the crash may stay (it breaks nothing)
        assert all(".tmp-" in n and not n.endswith((".part", ".new")) for n in extra), extra

    assert check_crash_states(rec, tmp_path, check) > 20


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done: skip interpreter teardown, where gloo's threads sometimes abort (as collective_worker.py)

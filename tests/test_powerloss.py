"""Power loss during every checkpoint write path (tests/powerloss.py, docs/format.md §10.6).

Each test builds a repository, records one operation's file operations, and checks every crash state the
durability model allows (up to ``LUOPAN_POWERLOSS_STATES`` per operation): the repository opens; every checkpoint
committed before the operation loads bit for bit; the one in flight is wholly there (loading bit for bit) or wholly
absent, and there if the operation had returned; and the repository takes a new save afterwards.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import luopan
from luopan.cli.main import app
from typer.testing import CliRunner
from luopan.format.canonical import inflate_json, unseal
from luopan.format.names import manifest_key

from .crashstates import CrashState, check_crash_states
from .helpers import assert_exact, assert_lora_loads, config_version, data_module
from .powerloss import Recorder

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHUNK = 16 << 10
POLICY = luopan.DeltaPolicy(min_bytes=64 << 10, xor_min_bytes=64 << 10)


def open_repo(path, **kw):
    return luopan.open(path, chunk_size=CHUNK, pack_size=64 << 10, delta_policy=POLICY, progress=False, **kw)


def steps_of(repo, run):
    try:
        return {c.step for c in repo.checkpoints(run)}
    except luopan.LuopanError:
        return set()


class Checkpoints:
    """What a repository must hold in every crash state: ``before`` (run, step) -> state, all committed before the
    recorded operation; ``inflight`` (run, step) -> state, wholly there or wholly absent (there once acked);
    ``gone`` (run, step) pairs the operation removes (either way is fine, but if present they load exactly)."""

    def __init__(self, before, inflight=None, *, repo="repo", save_after=True):
        self.before, self.inflight, self.repo, self.save_after = before, inflight or {}, repo, save_after
        self.states = 0

    def __call__(self, state: CrashState) -> None:
        r = open_repo(os.path.join(state.root, self.repo))
        try:
            runs = {run for run, _ in (*self.before, *self.inflight)}
            listed = {(run, s) for run in runs for s in steps_of(r, run)}
            for key, want in self.before.items():
                assert key in listed, f"{key} was committed before the operation and is gone"
                assert_exact(r.load(key[0], step=key[1]), want)
            for key, want in self.inflight.items():
                if ("done", key) in state.acks:
                    assert key in listed, f"{key} was acknowledged and is gone"
                if key in listed:
                    assert_exact(r.load(key[0], step=key[1]), want)
            if self.save_after and self.states % 7 == 0:  # the repository keeps working (a sample: saves cost)
                r.save("after", 1, {"x": np.arange(10)})
                assert_exact(r.load("after", step=1), {"x": np.arange(10)})
            self.states += 1
        finally:
            r.close()


def record(world, op):
    with Recorder(world) as rec:
        op(rec)
    return rec


def table(seed, rows=1024, dim=64):
    return np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)


def manifest_doc(root, run, step):
    with open(os.path.join(root, manifest_key(run, step)), "rb") as f:
        return unseal(inflate_json(f.read()))


def test_full_save(tmp_path):
    world = tmp_path / "w"
    s1 = {"w": table(1), "shared": np.arange(5000.0), "meta": {"step": 1, "name": "é"}}
    s2 = {"w": table(2), "shared": np.arange(5000.0), "meta": {"step": 2, "name": "é"}}
    open_repo(world / "repo").save("r", 1, s1)

    def op(rec):
        repo = open_repo(world / "repo")
        repo.save("r", 2, s2, metrics={"loss": 0.5})
        rec.ack(("done", ("r", 2)))
        repo.close()

    rec = record(world, op)
    assert any(e.kind == "fsync" for e in rec.events)
    assert check_crash_states(rec, tmp_path, Checkpoints({("r", 1): s1}, {("r", 2): s2})) > 20


def test_first_save_into_a_new_repository(tmp_path):
    """Every directory a new repository makes is synced into its parent before the save returns."""
    world = tmp_path / "w"
    s1 = {"w": table(1, 256)}

    def op(rec):
        repo = open_repo(world / "repo")
        repo.save("r", 1, s1)
        rec.ack(("done", ("r", 1)))
        repo.close()

    rec = record(world, op)
    check_crash_states(rec, tmp_path, Checkpoints({}, {("r", 1): s1}, save_after=False))


def test_row_delta_save_with_segments(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    emb = table(0, 2048, 64)  # 512 KiB: a row-delta candidate under POLICY
    repo = open_repo(root)
    saved = {}
    rng = np.random.default_rng(1)
    for step in range(3):
        if step:
            emb[rng.choice(len(emb), 12, replace=False)] += 1
        repo.save("emb", step, {"emb": emb})
        saved[("emb", step)] = {"emb": emb.copy()}
    repo.close()
    emb[rng.choice(len(emb), 12, replace=False)] += 1
    new = {"emb": emb.copy()}

    def op(rec):
        r = open_repo(root)
        r.save("emb", 3, new)
        rec.ack(("done", ("emb", 3)))
        r.close()

    rec = record(world, op)
    delta = manifest_doc(root, "emb", 3)["entries"][0]["delta"]
    assert len(delta.get("segments", [])) >= 2, delta  # the operation really appended a segment
    check_crash_states(rec, tmp_path, Checkpoints(saved, {("emb", 3): new}))


def test_xor_delta_save(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    base = {"w": (np.random.default_rng(0).standard_normal(64 << 10) * 0.02).astype(np.float32)}
    moved = {"w": base["w"] + np.float32(1e-6) * np.sign(base["w"])}
    open_repo(root, compression="zstd").save("ft", 0, base)

    def op(rec):
        r = open_repo(root)
        r.save("ft", 1, moved)
        rec.ack(("done", ("ft", 1)))
        r.close()

    rec = record(world, op)
    assert "xor" in manifest_doc(root, "ft", 1)["entries"][0], "the save was not an XOR delta"
    check_crash_states(rec, tmp_path, Checkpoints({("ft", 0): base}, {("ft", 1): moved}))


def test_save_with_entry_groups(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    rng = np.random.default_rng(3)
    s0 = {f"layer{i:02d}": rng.standard_normal(64, dtype=np.float32) for i in range(40)}
    s1 = {**s0, "layer00": s0["layer00"] + 1}
    s2 = {**s1, "layer01": s1["layer01"] + 1}
    r = open_repo(root)
    r.save("g", 0, s0)
    r.save("g", 1, s1)
    r.close()

    def op(rec):
        r = open_repo(root)
        r.save("g", 2, s2)
        rec.ack(("done", ("g", 2)))
        r.close()

    rec = record(world, op)
    assert manifest_doc(root, "g", 2).get("groups"), "the save did not use entry groups"
    check_crash_states(rec, tmp_path, Checkpoints({("g", 0): s0, ("g", 1): s1}, {("g", 2): s2}))


def _history(root, n=5):
    r = open_repo(root)
    saved = {}
    for step in range(n):
        s = {"w": table(step, 256), "shared": np.arange(3000.0)}
        r.save("h", step, s)
        saved[("h", step)] = s
    return r, saved


def test_prune_and_rm(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    r, saved = _history(root)
    r.close()
    keep = {k: v for k, v in saved.items() if k[1] == 4}
    gone = {k: v for k, v in saved.items() if k[1] != 4}

    def op(rec):
        r = open_repo(root)
        r.delete("h", 0)
        r.prune("h", luopan.retention.KeepLast(1))
        rec.ack("pruned")
        r.close()

    rec = record(world, op)
    check_crash_states(rec, tmp_path, Checkpoints(keep, gone))


def test_gc_with_repack(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    r, saved = _history(root)
    for step in (0, 1, 2):
        r.delete("h", step)
    r.close()
    live = {k: v for k, v in saved.items() if k[1] >= 3}

    def op(rec):
        r = open_repo(root)
        report = r.gc(grace=0, repack_below=0.99)
        rec.ack("gc")
        r.close()
        assert report.deleted_packs or report.repacked_packs, report

    rec = record(world, op)
    check_crash_states(rec, tmp_path, Checkpoints(live))


def test_upgrade(tmp_path):
    """``luopan upgrade`` of a format-6 repository (tests/data/v6_repo): in every crash state the repository opens
    at format 6 or 7 (7 once acknowledged) and every checkpoint loads exactly."""
    import shutil

    world = tmp_path / "w"
    shutil.copytree(os.path.join(DATA, "v6_repo", "auto"), world / "repo")
    gen = data_module("make_v6_repo")
    os.sync()

    def op(rec):
        result = CliRunner().invoke(app, ["upgrade", "-r", str(world / "repo")], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        rec.ack("upgraded")

    rec = record(world, op)
    assert config_version(world / "repo") == 8

    def check(state):
        root = os.path.join(state.root, "repo")
        version = config_version(root)
        assert version in (6, 8), version
        if "upgraded" in state.acks:
            assert version == 8
        r = luopan.open(root, progress=False)
        try:
            assert_lora_loads(r, gen, gen.STEPS)
        finally:
            r.close()

    assert check_crash_states(rec, tmp_path, check) > 5


def test_the_simulator_is_not_vacuous(tmp_path):
    """A store that renames a manifest into place without syncing its bytes first loses the checkpoint in some
    crash state, and the simulation finds that state."""
    world = tmp_path / "w"
    s0 = {"w": table(1, 64)}
    open_repo(world / "repo").save("r", 0, s0)
    rec = Recorder(world)
    rec.start()
    recorded_fsync = os.fsync
    try:
        os.fsync = lambda fd: None if _is_manifest_tmp(fd) else recorded_fsync(fd)
        r = open_repo(world / "repo")
        r.save("r", 1, s0)
        rec.ack(("done", ("r", 1)))
        r.close()
    finally:
        os.fsync = recorded_fsync
        rec.stop()
    with pytest.raises(AssertionError, match="crash after event"):
        check_crash_states(rec, tmp_path, Checkpoints({("r", 0): s0}, {("r", 1): s0}), budget=400)


def _is_manifest_tmp(fd):
    target = os.readlink(f"/proc/self/fd/{fd}")
    return f"{os.sep}ckpt{os.sep}" in target and ".tmp-" in target

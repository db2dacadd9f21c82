"""Garbage collection (luopan.repository.gc, docs/format.md §10.3): what it frees, what it never touches, its two phases,
repacking, locks, and a crash at every named point of every phase."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan._crash import CRASH_EXIT_CODE
from luopan.cli.main import app
from luopan.format.names import manifest_key, pack_key
from luopan.repository.gc import CONDEMNED_KEY, collect
from luopan.repository.locks import acquire, list_locks
from luopan.retention import KeepLast

from .conftest import PYTHON
from .helpers import assert_same_state

CHUNK = 64 << 10
PACK = 512 << 10


def states(n: int, seed: int = 0) -> list[dict]:
    """n states: a shared 'base' (same every step), 'w' new every step, 'b' new every second step."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(100_000).astype(np.float32)
    out = []
    b = rng.standard_normal(50_000).astype(np.float32)
    for s in range(n):
        if s % 2 == 0:
            b = rng.standard_normal(50_000).astype(np.float32)
        out.append({"base": base, "w": rng.standard_normal(60_000).astype(np.float32), "b": b, "step": s})
    return out


def make_repo(path, n=8, run="a", **kw):
    repo = luopan.open(path, chunk_size=CHUNK, pack_size=PACK, **kw)
    sts = dict(enumerate(states(n)))
    for s, st in sts.items():
        repo.save(run, s, st, metrics={"loss": 1.0 / (s + 1)})
    return repo, sts


def packs_of(repo) -> set[str]:
    return {k for k in repo.store.list("packs/")}


def referenced_packs(repo) -> set[str]:
    out = set()
    for r in repo.runs():
        for s in repo.steps(r):
            out |= {pack_key(p) for p in repo.manifest(r, s).doc["packs"]}
    return out


def check_all(repo, sts, run="a"):
    repo.verify()
    for s in repo.steps(run):
        assert_same_state(repo.load(run, s), sts[s])


def test_prune_then_gc_frees_exactly_the_unreferenced_packs(tmp_path):
    repo, sts = make_repo(tmp_path / "r")
    before = packs_of(repo)
    repo.prune("a", KeepLast(2))
    live = referenced_packs(repo)
    assert live < before
    rep = repo.gc(grace=0, repack_below=0)
    assert packs_of(repo) == live
    assert rep.deleted_packs == len(before - live) and rep.deleted_bytes > 0
    assert rep.live_packs == len(live) and rep.manifests == 2
    assert not repo.store.exists(CONDEMNED_KEY)
    check_all(repo, sts)
    again = repo.gc(grace=0, repack_below=0)  # idempotent: nothing more to do
    assert (again.deleted_packs, again.repacked_packs, again.condemned_packs) == (0, 0, 0)
    assert again.index_files_after == 1
    # the process that ran gc keeps saving correctly (its cached chunk locations were refreshed)
    repo.save("a", 100, sts[0])
    repo.verify()
    assert_same_state(repo.load("a", 100), sts[0])


def test_two_phases_wait_for_the_grace_period(tmp_path):
    repo, sts = make_repo(tmp_path / "r")
    repo.prune("a", KeepLast(3))
    before = packs_of(repo)
    t0 = 2_000_000_000.0  # "now" of the first run, well after the packs were written
    first = collect(repo, grace=600, repack_below=0, now=t0)
    assert first.deleted_packs == 0 and first.condemned_packs > 0
    assert packs_of(repo) == before  # condemned, not deleted
    assert first.next_sweep_after == t0 + 600
    early = collect(repo, grace=600, repack_below=0, now=t0 + 599)
    assert early.deleted_packs == 0 and early.condemned_packs == first.condemned_packs
    late = collect(repo, grace=600, repack_below=0, now=t0 + 600)
    assert late.deleted_packs == first.condemned_packs
    assert packs_of(repo) == referenced_packs(repo)
    check_all(repo, sts)


def test_young_unreferenced_packs_are_left_for_a_save_in_progress(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=2)
    # A pack of a save that has not committed its manifest yet (e.g. a writer whose lock was broken).
    orphan = next(iter(packs_of(repo)))
    data = repo.store.get(orphan)
    stray = "packs/ff/" + "f" * 64 + ".pack"
    repo.store.put(stray, data)
    rep = repo.gc(grace=3600)
    assert rep.young_packs == 1 and repo.store.exists(stray)
    rep = collect(repo, grace=3600, now=repo.store.modified(stray) + 3601)  # old enough: condemned, not deleted
    assert rep.condemned_packs == 1 and repo.store.exists(stray)


def test_a_pack_referenced_again_is_not_deleted(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=4)
    old = repo.store.get(manifest_key("a", 0))
    repo.prune("a", KeepLast(1))
    t0 = 2_000_000_000.0
    first = collect(repo, grace=60, repack_below=0, now=t0)
    assert first.condemned_packs
    # A writer commits a manifest naming condemned packs (here: step 0's manifest comes back) before the sweep.
    repo.store.put(manifest_key("a", 0), old)
    late = collect(repo, grace=60, repack_below=0, now=t0 + 61)
    assert referenced_packs(repo) <= packs_of(repo)  # what step 0 needs survived the sweep
    assert late.deleted_packs < first.condemned_packs
    check_all(repo, sts)
    assert repo.steps("a") == [0, 3]
    # and its packs are listed for deduplication again
    again = collect(repo, grace=60, repack_below=0, now=t0 + 200)
    assert again.deleted_packs == 0


def test_repack_moves_live_chunks_and_rewrites_manifests(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=6)
    repo.prune("a", KeepLast(1))
    keep = repo.steps("a")
    assert keep == [5]
    before_doc = repo.manifest("a", 5).doc
    rep = repo.gc(grace=0, repack_below=0.9)
    assert rep.repacked_packs >= 1 and rep.manifests_rewritten == 1 and rep.new_packs >= 1
    after_doc = repo.manifest("a", 5).doc
    # same chunks (content), possibly new places; everything still verifies and loads
    hashes = lambda d: [r[0] for e in d["entries"] for r in e.get("chunks", [])]  # noqa: E731
    assert hashes(after_doc) == hashes(before_doc)
    assert after_doc["packs"] != before_doc["packs"]
    assert packs_of(repo) == referenced_packs(repo)
    check_all(repo, sts)
    # the latest ref follows the rewritten manifest
    from luopan.format.canonical import sealed_checksum, unseal

    ref = unseal(repo.store.get("refs/runs/a/latest.json"))
    assert ref["manifest"] == manifest_key("a", 5)
    assert ref["manifest_checksum"] == sealed_checksum(repo.store.get(manifest_key("a", 5)))
    total = sum(repo.store.size(k) for k in packs_of(repo))
    assert total <= rep.live_bytes + 4096 * len(packs_of(repo))  # nothing dead left in packs


def test_repack_skips_a_pack_with_a_damaged_live_chunk(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=6)
    repo.prune("a", KeepLast(1))
    m = repo.manifest("a", 5)
    h, p, off, length, *_ = m.doc["entries"][0]["chunks"][0]
    key = pack_key(m.doc["packs"][p])
    path = os.path.join(repo.store.root, *key.split("/"))
    with open(path, "r+b") as f:
        f.seek(off + 10)
        f.write(b"\xff\xfe\xfd")
    rep = repo.gc(grace=0, repack_below=0.99)
    assert any(s.startswith(m.doc["packs"][p]) for s in rep.skipped_repacks)
    assert repo.store.exists(key)  # the damaged pack is kept (its other chunks may be fine); verify names it
    with pytest.raises(luopan.IntegrityError):
        repo.verify()


def test_row_delta_base_chunks_survive_pruning_the_base(tmp_path):
    policy = luopan.DeltaPolicy(min_bytes=1 << 16, rebase_fraction=0.5)
    repo = luopan.open(tmp_path / "r", chunk_size=CHUNK, pack_size=PACK, delta_policy=policy)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((4096, 64)).astype(np.float32)  # 1 MiB
    sts = []
    for s in range(5):
        table = table.copy()
        table[rng.integers(0, 4096, 20)] += 1.0
        sts.append({"emb": table})
        repo.save("t", s, sts[-1])
    assert any("delta" in e for e in repo.manifest("t", 4).doc["entries"])
    repo.prune("t", KeepLast(1))
    repo.gc(grace=0, repack_below=0.9)
    repo.verify()
    assert_same_state(repo.load("t", 4), sts[4])


def test_records_evals_pins_and_other_runs_are_kept(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=5)
    repo.save("other", 1, sts[1])
    repo.run("a").pin(1, tag="keep-me")
    repo.run("a").log_eval(1, {"acc": 0.5}, samples=[{"q": "x", "a": "y"}])
    repo.prune("a", KeepLast(1))
    assert repo.steps("a") == [1, 4]
    non_pack = {k for k in repo.store.list("") if not k.startswith(("packs/", "index/", "locks/", "gc/"))}
    repo.gc(grace=0, repack_below=0.9)
    after = {k for k in repo.store.list("") if not k.startswith(("packs/", "index/", "locks/", "gc/"))}
    assert after == non_pack  # records, evals, pins, manifests, refs all still there
    assert repo.run("a").pins()[1]["tag"] == "keep-me"
    check_all(repo, sts)
    assert_same_state(repo.load("other", 1), sts[1])


def test_a_damaged_manifest_stops_gc_before_anything_is_deleted(tmp_path):
    repo, sts = make_repo(tmp_path / "r", n=4)
    repo.prune("a", KeepLast(2))
    before = set(repo.store.list(""))
    key = manifest_key("a", 3)
    data = bytearray(repo.store.get(key))
    data[50] ^= 1
    repo.store.put(key, bytes(data))
    with pytest.raises(luopan.GcError, match="damaged"):
        repo.gc(grace=0)
    assert set(repo.store.list("")) == before
    assert not list_locks(repo.store)  # the lock was released


def test_dry_run_reports_the_real_run_and_changes_nothing(tmp_path):
    repo, _ = make_repo(tmp_path / "r")
    repo.prune("a", KeepLast(2))
    listing = {k: repo.store.get(k) for k in repo.store.list("")}
    dry = repo.gc(grace=0, repack_below=0.9, dry_run=True)
    assert {k: repo.store.get(k) for k in repo.store.list("")} == listing
    real = repo.gc(grace=0, repack_below=0.9)
    assert real.repacked_packs and real.deleted_packs > real.repacked_packs  # both kinds of work happened
    for f in ("deleted_packs", "deleted_bytes", "repacked_packs", "repacked_bytes", "live_packs", "manifests",
              "packs", "copied_bytes"):
        assert getattr(dry, f) == getattr(real, f), f


def test_gc_waits_for_saves_and_reports_a_held_lock(tmp_path):
    repo, _ = make_repo(tmp_path / "r", n=2)
    held = acquire(repo.store, "shared", "save of x step 1")
    repo.lock_timeout = 0.3
    with pytest.raises(luopan.LockedError, match="shared lock for save of x step 1"):
        repo.gc(grace=0)
    held.release()
    repo.gc(grace=0)
    assert not list_locks(repo.store)


def test_invalid_arguments(tmp_path):
    repo, _ = make_repo(tmp_path / "r", n=1)
    with pytest.raises(ValueError, match="grace"):
        repo.gc(grace=-1)
    with pytest.raises(ValueError, match="repack_below"):
        repo.gc(repack_below=1.5)


def test_cli_gc_locks_unlock(tmp_path):
    repo, _ = make_repo(tmp_path / "r")
    repo.prune("a", KeepLast(2))
    runner = CliRunner()
    r = runner.invoke(app, ["gc", "-r", str(tmp_path / "r"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "dry run: nothing changed" in r.output
    r = runner.invoke(app, ["gc", "-r", str(tmp_path / "r"), "--grace", "0", "--json"])
    assert r.exit_code == 0, r.output
    import json

    doc = json.loads(r.output)
    assert doc["deleted_packs"] > 0 and doc["dry_run"] is False
    r = runner.invoke(app, ["gc", "-r", str(tmp_path / "r"), "--grace", "soon"])
    assert r.exit_code == 2 and "duration" in r.output
    # a lock left by a dead process on this host: listed as stale, removed by unlock
    proc = subprocess.run([PYTHON, "-c", "import sys, luopan.repository.locks as L, luopan.store as S; "
                           "L.acquire(S.LocalStore(sys.argv[1]), 'exclusive', 'gc'); import os; os._exit(0)",
                           str(tmp_path / "r")], env={**os.environ, "PYTHONPATH": "src"}, check=True)
    assert proc.returncode == 0
    r = runner.invoke(app, ["locks", "-r", str(tmp_path / "r")])
    assert "stale" in r.output and "exclusive lock for gc" in r.output
    r = runner.invoke(app, ["unlock", "-r", str(tmp_path / "r")])
    assert "1 lock(s) removed" in r.output
    assert runner.invoke(app, ["locks", "-r", str(tmp_path / "r")]).output.strip() == "no locks"


def test_a_lock_of_a_dead_process_does_not_block_a_save(tmp_path, child_env):
    repo, sts = make_repo(tmp_path / "r", n=1)
    subprocess.run([PYTHON, "-c", "import sys, os, luopan.repository.locks as L, luopan.store as S; "
                    "L.acquire(S.LocalStore(sys.argv[1]), 'exclusive', 'gc'); os._exit(0)", str(tmp_path / "r")],
                   env=child_env, check=True)
    assert len(list_locks(repo.store)) == 1
    repo.lock_timeout = 5
    with pytest.warns(UserWarning, match="stale repository lock"):
        repo.save("a", 1, sts[0])
    assert not list_locks(repo.store)


# -- crash points ---------------------------------------------------------------------------------------------------

GC_POINTS = ["gc.marked", "gc.repack.packs", "gc.repack.manifest", "gc.index.written", "gc.index.replaced",
             "gc.condemned", "gc.sweep.pack", "gc.done"]

CHILD = '''
import sys
import luopan
repo = luopan.open(sys.argv[1])
repo.gc(grace=0, repack_below=0.9)
'''


@pytest.mark.parametrize("point", GC_POINTS)
def test_a_crash_at_any_gc_phase_leaves_only_garbage(tmp_path, child_env, point):
    repo, sts = make_repo(tmp_path / "r", n=6)
    repo.save("b", 1, sts[2])
    repo.prune("a", KeepLast(2))
    repo.close()
    env = {**child_env, "LUOPAN_CRASH_AT": point}
    proc = subprocess.run([PYTHON, "-c", CHILD, str(tmp_path / "r")], env=env, capture_output=True, text=True)
    assert proc.returncode == CRASH_EXIT_CODE, proc.stderr
    repo = luopan.open(tmp_path / "r")
    # never a manifest pointing at missing data: every retained checkpoint verifies and loads
    check_all(repo, sts)
    assert_same_state(repo.load("b", 1), sts[2])
    assert repo.steps("a") == [4, 5]
    # saving works (a stale lock of the dead gc is removed on the way) and the next gc finishes the job
    with pytest.warns(UserWarning, match="stale repository lock"):
        repo.save("a", 50, sts[5])
    repo.gc(grace=0, repack_below=0.9)
    assert packs_of(repo) == referenced_packs(repo)
    assert len(list(repo.store.list("index/"))) == 1
    check_all(repo, {**sts, 50: sts[5]})


def test_open_options_for_locks_and_space(tmp_path):
    repo = luopan.open(tmp_path / "r", lock_timeout=2.5, space_margin=0)
    assert (repo.lock_timeout, repo.space_margin) == (2.5, 0)
    assert luopan.open(tmp_path / "r", lock_timeout=np.int64(10**6), space_margin=np.float32(2.0)).space_margin == 2
    assert luopan.open(tmp_path / "r", lock_timeout=10**400).lock_timeout == 10**400  # big ints are numbers too
    assert luopan.open(tmp_path / "r", lock_timeout=None).lock_timeout is None  # wait forever
    for bad in ({"lock_timeout": -1}, {"space_margin": -0.5}, {"space_margin": float("nan")}):
        with pytest.raises(ValueError):
            luopan.open(tmp_path / "new", **bad)
        assert not (tmp_path / "new").exists()  # refused before anything was created


def test_bad_open_options_and_a_lock_record_taken_back_after_an_error(tmp_path, monkeypatch):
    for bad in ({"space_margin": float("inf")}, {"space_margin": "2"}, {"lock_timeout": "5"},
                {"storage_options": {"endpoint_url": "http://x"}}):
        with pytest.raises(ValueError):
            luopan.open(tmp_path / "new", **bad)
    assert not (tmp_path / "new").exists()
    # an error between writing a shared lock record and checking for exclusive holders takes the record back (the
    # record protocol: where flock stands in for shared records, see test_flocks.py)
    monkeypatch.setenv("LUOPAN_LOCK_RECORDS", "1")
    repo = luopan.open(tmp_path / "r")
    import luopan.repository.locks as locks_mod

    real = locks_mod.list_locks
    calls = {"n": 0}

    def flaky(store):
        calls["n"] += 1
        if calls["n"] == 1:  # a shared locker lists once, after writing its record
            raise KeyboardInterrupt
        return real(store)

    monkeypatch.setattr(locks_mod, "list_locks", flaky)
    with pytest.raises(KeyboardInterrupt):
        repo.save("a", 1, {"x": np.ones(3)})
    monkeypatch.setattr(locks_mod, "list_locks", real)
    assert calls["n"] == 1
    assert list_locks(repo.store) == []
    assert repo.steps("a") == []
    repo.gc(grace=0)  # not blocked by a leftover record


def test_cli_grace_accepts_any_spelling_of_zero(tmp_path):
    make_repo(tmp_path / "r", n=2)
    for zero in ("0", "0.0", "00", "0s", "0h"):
        r = CliRunner().invoke(app, ["gc", "-r", str(tmp_path / "r"), "--grace", zero, "--json"])
        assert r.exit_code == 0, (zero, r.output)
        assert '"grace": 0.0' in r.output


def test_which_lock_holders_count_as_gone():
    """Only what is certain: a dead or reused pid of this boot and pid namespace, or an earlier boot of this very
    machine. A machine that shares the hostname, or another pid namespace, is never judged by its pid."""
    import dataclasses

    from luopan.repository.locks import _HOST, _boot_id, _machine_id, _pidns, _start_time, LockRecord

    me = LockRecord("locks/x.json", "shared", "save", _HOST, os.getpid(), _pidns(), _boot_id(), _machine_id(),
                    _start_time(os.getpid()), 0.0, 0.0)
    assert not me.holder_gone()
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert dataclasses.replace(me, pid=int(dead.stdout)).holder_gone()
    if me.started is not None:  # /proc available: a reused pid runs a process with another start time
        assert dataclasses.replace(me, started=me.started - 1).holder_gone()
    assert not dataclasses.replace(me, pid=int(dead.stdout), pidns="pid:[1]").holder_gone()
    assert not dataclasses.replace(me, pid=int(dead.stdout), host="elsewhere").holder_gone()
    other_boot = dataclasses.replace(me, boot="another-boot-id")
    assert other_boot.holder_gone() == bool(_machine_id())  # a reboot of this machine (needs a machine id)
    assert not dataclasses.replace(other_boot, machine="another-machine-with-our-hostname").holder_gone()
    # a record without a machine id (an older luopan): same boot id, dead pid -> gone all the same
    assert dataclasses.replace(me, pid=int(dead.stdout), machine="").holder_gone()

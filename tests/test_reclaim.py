"""repo.delete(run, step, reclaim=True) (issue 31, docs/format.md §10.3.1): the packs only the deleted checkpoint
named are freed at once, index files stop naming them first, a pack another manifest names stays, later saves still
deduplicate correctly; every crash point and every power-loss state leaves a valid repository."""

from __future__ import annotations

import os
import subprocess

import numpy as np

import luopan
from luopan.format.index import parse_index
from luopan.format.names import is_index_key, pack_key

from .conftest import PYTHON
from .crashstates import check_crash_states
from .helpers import assert_exact
from .test_powerloss import Checkpoints, open_repo, record, table


def _history(root, n=4):
    """Checkpoints whose tables change and whose 4-byte score does not: every later one names the first one's pack
    for the score alone (a reclaim of step 0 repacks it)."""
    r = open_repo(root)
    saved = {}
    for step in range(n):
        s = {"w": table(step, 128), "score": np.array([0.5], dtype=np.float32)}
        r.save("h", step, s)
        saved[("h", step)] = s
    return r, saved


def packs_of(r, run, step):
    return set(r.checkpointing.manifest(run, step).packs)


def indexed_packs(store):
    out = set()
    for key in store.list("index/"):
        if is_index_key(key):
            out |= {loc.pack for loc in parse_index(store.get(key), key).values()}
    return out


def test_reclaim_frees_only_packs_no_other_manifest_names(tmp_path):
    r = open_repo(tmp_path / "repo")
    a0, a1 = {"w": np.random.default_rng(0).standard_normal(20000)}, {"w": np.random.default_rng(1).standard_normal(20000)}
    r.save("a", 0, a0)
    r.save("a", 1, a1)
    r.save("b", 0, {"same": a1["w"], "own": np.ones(5000)})  # names a/1's packs (dedup)
    own0, own1 = packs_of(r, "a", 0), packs_of(r, "a", 1)
    assert r.delete("a", 0, reclaim=True)
    freed = r.repository.last_reclaim
    assert freed.packs == len(own0) and freed.bytes > 0 and freed.index_files >= 1
    assert not any(r.store.exists(pack_key(p)) for p in own0)
    assert not own0 & indexed_packs(r.store)  # no save can deduplicate against a freed pack
    assert r.delete("a", 1, reclaim=True)
    assert r.repository.last_reclaim.packs == 0 and r.repository.last_reclaim.kept == len(own1 & packs_of(r, "b", 0))
    assert all(r.store.exists(pack_key(p)) for p in packs_of(r, "b", 0))
    r.save("a", 2, a0)  # the freed chunks are stored again, not referenced where they were
    assert_exact(r.load("a", 2), a0)
    r.verify()
    assert r.gc(grace=0, repack_below=0).deleted_packs == 0  # nothing left for gc: reclaim freed it all
    r.close()


def test_a_pack_others_barely_need_is_repacked_and_freed(tmp_path):
    r = open_repo(tmp_path / "repo")
    score = np.array([0.25], dtype=np.float32)  # a score tensor: dedups into the first checkpoint's pack
    a0 = {"w": np.random.default_rng(0).standard_normal(20000), "score": score}
    b0 = {"w": np.random.default_rng(1).standard_normal(20000), "score": score}
    r.save("a", 0, a0)
    r.save("b", 0, b0)
    own0 = packs_of(r, "a", 0)
    assert own0 & packs_of(r, "b", 0)  # b/0 names a/0's pack for 4 bytes
    assert r.delete("a", 0, reclaim=True)
    done = r.repository.last_reclaim
    assert done.repacked >= 1 and done.manifests_rewritten == 1 and done.kept == 0
    assert not any(r.store.exists(pack_key(p)) for p in own0)
    assert_exact(r.load("b", 0), b0)
    r.verify()
    assert r.gc(grace=0, repack_below=0).deleted_packs == 0
    r.close()


def test_without_reclaim_the_bytes_wait_for_gc(tmp_path):
    r = open_repo(tmp_path / "repo")
    r.save("a", 0, {"w": np.random.default_rng(0).standard_normal(20000)})
    r.save("a", 1, {"w": np.random.default_rng(1).standard_normal(20000)})
    own0 = packs_of(r, "a", 0)
    r.delete("a", 0)
    assert all(r.store.exists(pack_key(p)) for p in own0)
    r.close()


def test_every_crash_point_leaves_a_valid_repository(tmp_path, child_env):
    for point in ("reclaim.repack.manifest", "reclaim.index.written", "reclaim.index.replaced", "reclaim.pack"):
        root = tmp_path / point
        r, saved = _history(root)
        r.gc(grace=0, repack_below=0)  # one index file for every pack: the reclaim rewrites it without step 0's
        r.close()
        code = ("import sys; sys.path.insert(0, %r); from tests.test_powerloss import open_repo; "
                "r = open_repo(%r); r.delete('h', 0, reclaim=True)") % (os.path.dirname(os.path.dirname(
                    os.path.abspath(__file__))), str(root))
        proc = subprocess.run([PYTHON, "-c", code], env={**child_env, "LUOPAN_CRASH_AT": point},
                              capture_output=True, timeout=120)
        assert proc.returncode != 0, f"{point} was not reached"
        r = open_repo(root)
        present = {p.rsplit("/", 1)[-1][:-5] for p in r.store.list("packs/")}
        assert indexed_packs(r.store) <= present, point  # no index file names a missing pack
        for key, want in saved.items():
            if key[1] != 0:
                assert_exact(r.load(*key), want)
        r.verify()
        r.save("h", 9, saved[("h", 0)])  # deduplicates against what is left, stores the rest
        assert_exact(r.load("h", 9), saved[("h", 0)])
        r.gc(grace=0)
        r.close()


def test_power_loss_during_a_reclaiming_delete(tmp_path):
    world = tmp_path / "w"
    root = world / "repo"
    r, saved = _history(root)
    r.gc(grace=0, repack_below=0)  # one index file: the reclaim rewrites it (written, then the old one deleted)
    r.close()
    keep = {k: v for k, v in saved.items() if k[1] != 0}

    def op(rec):
        r = open_repo(root)
        r.delete("h", 0, reclaim=True)
        assert r.repository.last_reclaim.packs > 0 and r.repository.last_reclaim.repacked > 0
        rec.ack("deleted")
        r.close()

    rec = record(world, op)
    keeps = Checkpoints(keep, {})

    def check(state):
        keeps(state)
        with luopan.open(os.path.join(state.root, "repo"), create=False) as r:
            present = {p.rsplit("/", 1)[-1][:-5] for p in r.store.list("packs/")}
            assert indexed_packs(r.store) <= present  # a later save never references a freed pack
            if "deleted" in state.acks:
                assert 0 not in r.steps("h")

    assert check_crash_states(rec, tmp_path, check) > 10


def test_a_failing_write_or_fsync_during_reclaim_leaves_a_valid_repository(tmp_path):
    import errno
    import shutil

    from .faults import Faults

    base = tmp_path / "base"
    r, saved = _history(base / "repo")
    r.gc(grace=0, repack_below=0)
    r.close()

    def reclaiming(root):
        r = open_repo(root)
        try:
            r.delete("h", 0, reclaim=True)
        finally:
            r.close()

    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    counts = Faults.count(probe, lambda: reclaiming(probe / "repo"))
    tried = 0
    for call in ("write", "fsync", "rename"):
        for n in range(1, counts[call] + 1):
            world = tmp_path / f"{call}-{n}"
            shutil.copytree(base, world)
            with Faults(world, call, n, errno.EIO):
                try:
                    reclaiming(world / "repo")
                except OSError:
                    pass
            tried += 1
            r = open_repo(world / "repo")
            present = {p.rsplit("/", 1)[-1][:-5] for p in r.store.list("packs/")}
            assert indexed_packs(r.store) <= present, (call, n)
            for key, want in saved.items():
                if key[1] != 0 or 0 in r.steps("h"):
                    assert_exact(r.load(*key), want)
            r.verify()
            r.close()
    assert tried > 3

"""Running out of disk space during a save (docs/format.md §10 rules 2 and 6, errors.StorageFullError).

A small tmpfs stands in for a full disk, so these tests need root (mount) and are skipped otherwise.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import numpy as np
import pytest

import luopan
from luopan.format.canonical import unseal
from luopan.retention import KeepLast

RUN = "full"
CHUNK_SIZE = 64 * 1024
PACK_SIZE = 256 * 1024
TMPFS_SIZE = "12m"
FILLER_BYTES = 4 << 20


def _mounted_tmpfs(tmp_path, options):
    """Mount a tmpfs with `options` on a temp dir (skipping, with the reason, where that is impossible)."""
    if os.geteuid() != 0:
        pytest.skip("disk-full tests mount a small tmpfs, which needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("disk-full tests need the mount/umount commands")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """A 12 MiB tmpfs mounted on a temp dir; always unmounted afterwards."""
    yield from _mounted_tmpfs(tmp_path, f"size={TMPFS_SIZE}")


@pytest.fixture
def few_inodes_fs(tmp_path):
    """A tmpfs with plenty of bytes but only 40 inodes."""
    yield from _mounted_tmpfs(tmp_path, "size=64m,nr_inodes=40")


def test_running_out_of_inodes_is_a_typed_storage_full_error(few_inodes_fs):
    """Out of inodes fails file/directory creation (not a data write): still StorageFullError, nothing partial."""
    repo = luopan.open(few_inodes_fs / "repo", chunk_size=4096, pack_size=4096)
    repo.space_margin = 0  # these tests run into the full disk itself, past the preflight (tested below)
    committed = []
    with pytest.raises(luopan.StorageFullError, match="no space left"):
        for step in range(200):
            repo.save(RUN, step, {"x": np.random.default_rng(step).standard_normal(2048)})
            committed.append(step)
    assert committed and repo.steps(RUN) == committed
    assert repo.verify(RUN).ok


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def make_state(step):
    """~1.6 MiB; ~1.5 MiB of it new at every step, 128 KiB shared by all steps."""
    rng = np.random.default_rng(300 + step)
    return {
        "shared": np.random.default_rng(1).standard_normal((32, 1024), dtype=np.float32),
        "w": rng.standard_normal((384, 1024), dtype=np.float32),
        "step": step,
    }


def assert_same_state(got, expected):
    assert list(got) == list(expected)
    for k, v in expected.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            assert got[k].tobytes() == v.tobytes(), k
        else:
            assert got[k] == v


def temp_files(root):
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if ".tmp-" in f]


def pack_files(root):
    return {f[: -len(".pack")] for _, _, fs in os.walk(os.path.join(root, "packs")) for f in fs if f.endswith(".pack")}


def test_disk_full_fails_cleanly_and_recovers(small_fs):
    filler = small_fs / "filler.bin"
    with open(filler, "wb") as f:  # space we can give back later
        f.write(os.urandom(FILLER_BYTES))
        f.flush()
        os.fsync(f.fileno())
    root = small_fs / "repo"
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    repo.space_margin = 0

    saved = {}
    for step in range(100):
        state = make_state(step)
        free_before = free_bytes(small_fs)
        try:
            repo.save(RUN, step, state)
        except luopan.StorageFullError as exc:
            err, failed_step = exc, step
            break
        saved[step] = state
    else:
        pytest.fail("the 12 MiB tmpfs never filled up")

    assert len(saved) >= 2, f"only {len(saved)} saves fit before the disk filled"
    assert isinstance(err, OSError) and isinstance(err, luopan.LuopanError)
    assert "no space" in str(err)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno in (errno.ENOSPC, errno.EDQUOT)

    # nothing partial visible: only the complete checkpoints, each verifying and loading bit-exactly
    assert repo.steps(RUN) == sorted(saved)
    assert temp_files(root) == [], temp_files(root)
    # the failed save's packs were removed (rule 6): only packs named by committed manifests remain ...
    referenced = {p for s in saved for p in repo.manifest(RUN, s).packs}
    if pack_files(root) != referenced:
        # The disk filled at the manifest, after the index file naming the new packs was visible: other writers
        # may already deduplicate against them, so they are left to gc (rule 6). gc writes too: give space back.
        assert len(os.listdir(root / "index")) == len(saved) + 1
        os.unlink(filler)
        repo.gc(grace=0)
        repo.gc(grace=0)
        assert pack_files(root) == referenced
    else:  # the disk filled while packs were written: only index files of committed saves
        assert len(os.listdir(root / "index")) == len(saved)
        assert pack_files(root) == referenced
        # ... and the space came back (a failed save of ~1.5 MiB leaves at most a few directory pages behind)
        free_after = free_bytes(small_fs)
        assert abs(free_after - free_before) <= 64 * 1024, (free_before, free_after)

    reopened = luopan.open(root)
    for r in (repo, reopened):
        assert r.steps(RUN) == sorted(saved)
        report = r.verify()
        assert report.ok and report.checkpoints == len(saved)
        for s, state in saved.items():
            assert_same_state(r.load(RUN, s), state)
        with pytest.raises(luopan.CheckpointNotFoundError):
            r.load(RUN, failed_step)
    reopened.close()

    # give space back: the same save now succeeds and verifies
    if filler.exists():
        os.unlink(filler)
    state = make_state(failed_step)
    info = repo.save(RUN, failed_step, state)
    assert info.step == failed_step and info.new_chunks > 0
    assert repo.steps(RUN) == sorted([*saved, failed_step])
    assert repo.verify(RUN, failed_step).ok
    assert_same_state(repo.load(RUN, failed_step), state)
    assert_same_state(repo.load(RUN), state)
    assert repo.verify().ok
    repo.close()


def test_disk_full_on_first_save_leaves_empty_repo(small_fs):
    """A save that cannot fit at all leaves a usable, empty repository and its space free."""
    root = small_fs / "repo"
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    repo.space_margin = 0
    free_before = free_bytes(small_fs)
    big = {"w": np.random.default_rng(0).standard_normal(4 << 20, dtype=np.float32)}  # 16 MiB > 12 MiB tmpfs
    with pytest.raises(luopan.StorageFullError, match="no space"):
        repo.save(RUN, 0, big)
    assert repo.steps(RUN) == []
    assert pack_files(root) == set()
    assert temp_files(root) == []
    assert not os.path.exists(root / "index") or os.listdir(root / "index") == []
    record = root / "runs" / RUN / "record.json"  # written first, by design (its git diff depends on the checkout)
    record_bytes = os.stat(record).st_blocks * 512 if record.exists() else 0
    assert abs(free_bytes(small_fs) - free_before) - record_bytes <= 64 * 1024
    # a save that fits still works afterwards
    state = make_state(1)
    repo.save(RUN, 1, state)
    assert repo.verify().ok
    assert_same_state(repo.load(RUN), state)
    repo.close()


PAGE = 4096
STAGES = ("pack", "index", "manifest", "ref")


def _failed_stage(root, exc, step):
    """Which write of a save ran out of space: judged from the committed files and the error's file name."""
    manifest = root / "runs" / RUN / "ckpt" / f"{step:08d}.json"
    ref_path = root / "refs" / "runs" / RUN / "latest.json"
    ref_step = unseal(ref_path.read_bytes())["step"] if ref_path.exists() else None
    if manifest.exists() and (exc is not None or ref_step != step):
        return "ref"  # the manifest made it, the ref did not
    if exc is None:
        return "ok"
    msg = str(exc)
    if ".pack" in msg:
        return "pack"
    if f"{step:08d}.json" in msg:
        return "manifest"
    return "index"


@pytest.mark.parametrize("stage", STAGES)
def test_disk_full_at_each_write_of_a_save(small_fs, stage):
    """Leave just too little space for the pack, index, manifest or ref write of a save (found by sweeping the free
    space page by page). Whatever write fails: a save that raises committed nothing, one that returns committed
    everything; earlier checkpoints stay intact; no temporaries remain; after freeing space saving works."""
    root = small_fs / "repo"
    base = {"b": np.random.default_rng(9).standard_normal(64 * 1024, dtype=np.float32), "step": 0}
    nxt = make_state(1)

    def fresh_repo_with_step0():
        if root.exists():
            shutil.rmtree(root)
        r = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
        r.space_margin = 0
        r.save(RUN, 0, base)
        return r

    r = fresh_repo_with_step0()
    f0 = free_bytes(small_fs)
    r.save(RUN, 1, nxt)
    need = f0 - free_bytes(small_fs)  # net pages step 1 takes (the replaced ref's page comes back)
    r.close()

    seen = []
    filler = small_fs / "filler.bin"
    for k in range(-8, 3):
        r = fresh_repo_with_step0()
        step0_packs = pack_files(root)
        fill = free_bytes(small_fs) - (need + k * PAGE)
        with open(filler, "wb") as f:
            f.truncate(0)
            f.write(b"\xa5" * max(fill, 0))
            os.fsync(f.fileno())
        free_before = free_bytes(small_fs)
        try:
            r.save(RUN, 1, nxt)
            exc = None
        except luopan.StorageFullError as e:
            exc = e
        got = _failed_stage(root, exc, 1)
        seen.append((k, got))
        if got == stage:
            print(f"free-space sweep (pages vs need, outcome): {seen}")
            break
        r.close()
        os.unlink(filler)
    else:  # pragma: no cover
        pytest.fail(f"no free-space level made the save run out of space at the {stage} write: {seen}")

    assert temp_files(root) == [], temp_files(root)
    steps = r.steps(RUN)
    if exc is not None:
        assert "no space" in str(exc)
        assert steps == [0], (
            f"save raised StorageFullError ({exc}) at the {stage} write but left step(s) {steps} committed: "
            "a failed save must commit nothing (or not fail)"
        )
    else:
        assert steps == [0, 1]
        assert r.verify(RUN, 1).ok
        assert_same_state(r.load(RUN, 1), nxt)
    if stage in ("pack", "index"):
        # failed before its index file was durable: its packs were deleted again (rule 6), space is back
        assert pack_files(root) == step0_packs
        assert len(os.listdir(root / "index")) == 1
        assert abs(free_bytes(small_fs) - free_before) <= 64 * 1024
    assert r.verify(RUN, 0).ok
    assert_same_state(r.load(RUN, 0), base)

    os.unlink(filler)
    if 1 not in r.steps(RUN):
        r.save(RUN, 1, nxt)
    r.save(RUN, 2, make_state(2))  # also repairs a stale ref
    ref = unseal((root / "refs" / "runs" / RUN / "latest.json").read_bytes())
    assert ref["step"] == 2
    reopened = luopan.open(root)
    assert reopened.steps(RUN) == [0, 1, 2]
    assert reopened.verify().ok
    for s, st in ((0, base), (1, nxt), (2, make_state(2))):
        assert_same_state(reopened.load(RUN, s), st)
    reopened.close()
    r.close()


# -- space preflight (docs/format.md §10.4) ------------------------------------------------------------------------

def test_preflight_refuses_before_writing_and_says_what_gc_and_prune_free(small_fs):
    root = small_fs / "repo"
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    saved = {}
    for step in range(100):
        before = {k: repo.store.get(k) for k in repo.store.list("")}
        try:
            repo.save(RUN, step, make_state(step))
        except luopan.InsufficientSpaceError as exc:
            err = exc
            break
        saved[step] = make_state(step)
    else:
        pytest.fail("the preflight never refused on a 12 MiB tmpfs")
    assert len(saved) >= 2
    # refused before writing anything: the repository is byte for byte as before (no lock left either)
    assert {k: repo.store.get(k) for k in repo.store.list("")} == before
    assert err.free < err.needed == int(err.estimate * 1.5)
    assert isinstance(err, luopan.StorageFullError) and err.errno == errno.ENOSPC
    assert "nothing was written" in str(err) and "space_margin" in str(err)
    # pruning everything but the newest would free the older checkpoints' own packs: the message says so
    assert err.prune_frees > 0 and "luopan prune" in str(err)
    repo.prune(RUN, KeepLast(1))
    with pytest.raises(luopan.InsufficientSpaceError) as again:
        repo.save(RUN, step, make_state(step))
    assert again.value.gc_frees > 0 and "luopan gc --grace 0" in str(again.value)
    repo.gc(grace=0)
    repo.save(RUN, step, make_state(step))  # now it fits
    repo.verify()


def test_preflight_estimates_from_the_previous_checkpoint_of_the_run(tmp_path):
    """An incremental save needs room for what it will write, not for the whole state: when the whole state does
    not fit, the estimate counts only chunks that differ from the run's previous checkpoint (this process's last
    save, or after a restart the newest on disk)."""
    repo = luopan.open(tmp_path / "r", chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    free = {"bytes": 10**12}
    repo.store.free_bytes = lambda: free["bytes"]  # this store's disk, as the preflight sees it
    frozen = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)  # 7.6 MiB
    big = {"frozen": frozen, "adapter": np.ones(1000, np.float32)}
    repo.save(RUN, 0, big)
    free["bytes"] = 200 << 10  # room for the adapter, not for the state
    big["adapter"] += 1
    info = repo.save(RUN, 1, big)  # only the adapter's chunk differs from step 0
    assert info.stored_bytes < 64 << 10
    # a fresh process: the newest checkpoint on disk serves as the previous one
    fresh = luopan.open(tmp_path / "r")
    fresh.store.free_bytes = lambda: 200 << 10
    big["adapter"] += 1
    fresh.save(RUN, 2, big)
    # a change to the frozen part, or a run without history, is counted in full
    big["frozen"] = frozen + 1
    with pytest.raises(luopan.InsufficientSpaceError, match="about 7.7 MiB to write") as exc:
        fresh.save(RUN, 3, big)
    assert exc.value.estimate > frozen.nbytes
    with pytest.raises(luopan.InsufficientSpaceError, match="about 7.7 MiB to write"):
        fresh.save("other-run", 0, {"frozen": frozen, "adapter": big["adapter"]})
    assert fresh.steps(RUN) == [0, 1, 2] and "other-run" not in fresh.runs()
    fresh.space_margin = 0  # the check can be turned off
    fresh.save(RUN, 3, big)


def test_preflight_counts_a_row_delta_save_by_its_rows_not_its_base(tmp_path):
    """A table stored as row deltas changes most of its base's chunks a little: the estimate must not count the
    whole table for a save that writes a few rows."""
    policy = luopan.DeltaPolicy(min_bytes=1 << 20, rebase_fraction=0.08)
    repo = luopan.open(tmp_path / "r", chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE, delta_policy=policy)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((32_768, 64)).astype(np.float32)  # 8 MiB
    for step in range(3):  # full, full (row digests are computed from the first change on), then a row delta
        table[rng.integers(0, 32_768, 200)] += 1.0
        repo.save(RUN, step, {"emb": table})
    assert any("delta" in e for e in repo.manifest(RUN, 2).doc["entries"])
    repo.store.free_bytes = lambda: 6 << 20  # less than the table, ample for its changed rows
    table[rng.integers(0, 32_768, 200)] += 1.0
    info = repo.save(RUN, 3, {"emb": table})
    assert info.stored_bytes < 1 << 20

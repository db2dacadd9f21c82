"""Regression tests for the defects found by trying to break luopan (one test or more per item of the issue).

Each test reproduces the reported failure and fails without its fix: data loss through a symlinked run directory,
a run name with a final newline, `unlock` deleting files that are not locks, a retention typo, two leaves sharing a
key path, hostile numbers, filesystem errors, a lock leaked by an outage, stray keys and entries, CLI tracebacks,
and the smaller gaps (damaged pins/records/evals, masked arrays, oversized files, restore fallback).
"""

from __future__ import annotations

import os
import shutil
import tracemalloc

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.format.canonical import inflate_json, seal, unseal
from luopan.repository.locks import list_locks
from luopan.retention import KeepBest, KeepLast

RUN = "r"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def state(step: int, n: int = 4000) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(n).astype(np.float32), "b": np.full(7, step, np.int64)}


@pytest.fixture
def root(tmp_path):
    return tmp_path / "repo"


def two_checkpoints(root, run=RUN, **metrics):
    with luopan.open(root, chunk_size=4096) as repo:
        for step in (1, 2):
            repo.save(run, step, state(step), metrics={k: v[step - 1] for k, v in metrics.items()})


def reseal(path, edit):
    doc = unseal(inflate_json(path.read_bytes()))  # manifests may be zstd frames (§4)
    edit(doc)
    path.write_bytes(seal(doc))


def manifest(root, step, run=RUN):
    return root / "runs" / run / "ckpt" / f"{step:08d}.json"


# -- 1. a run directory that is a symlink -------------------------------------------------------------------------
def test_symlinked_run_directory_is_seen_by_every_walk(root, tmp_path):
    """A run moved to another disk and linked back: listing, gc marking, verify, du and prune all see it, so
    `gc --grace 0` keeps the packs its checkpoints need (it used to delete them)."""
    two_checkpoints(root, run="moved")
    two_checkpoints(root, run="stays")
    shutil.move(root / "runs" / "moved", tmp_path / "other-disk")
    os.symlink(tmp_path / "other-disk", root / "runs" / "moved")
    with luopan.open(root) as repo:
        assert repo.runs() == ["moved", "stays"]
        assert repo.du()["checkpoints"] == 4
        report = repo.gc(grace=0)
        assert report.manifests == 4 and report.deleted_packs == 0
        assert repo.verify().checkpoints == 4
        np.testing.assert_array_equal(repo.load("moved", 2)["w"], state(2)["w"])
        repo.prune("moved", KeepLast(1))
        assert repo.steps("moved") == [2]
        assert not (tmp_path / "other-disk" / "ckpt" / "00000001.json").exists()  # pruned through the link
        repo.gc(grace=0)
        np.testing.assert_array_equal(repo.load("moved")["w"], state(2)["w"])
        assert repo.verify().ok


def test_symlink_loop_is_walked_once_and_reported(root):
    two_checkpoints(root)
    os.symlink(root / "runs", root / "runs" / RUN / "loop")
    with luopan.open(root) as repo:
        assert repo.steps(RUN) == [1, 2]
        assert any("loop" in s.reason for s in repo.strays())
        assert repo.gc(grace=0).deleted_packs == 0


def _move_to_an_unmounted_disk(path, tmp_path) -> None:
    """Move ``path`` to tmp_path/disk, link it back, then make the link dangle (the disk is "unmounted"): renaming
    tmp_path/unmounted back to tmp_path/disk "mounts" it again."""
    shutil.move(path, tmp_path / "disk")
    os.symlink(tmp_path / "disk", path)
    os.rename(tmp_path / "disk", tmp_path / "unmounted")


def test_gc_refuses_when_a_linked_run_cannot_be_seen(root, tmp_path):
    """A run linked to a disk that is not mounted: gc must not delete what its checkpoints need."""
    two_checkpoints(root, run="away")
    _move_to_an_unmounted_disk(root / "runs" / "away", tmp_path)
    with luopan.open(root) as repo:
        packs = sorted((root / "packs").rglob("*.pack"))
        with pytest.raises(luopan.GcError, match="dangling symbolic link"):
            repo.gc(grace=0)
        assert sorted((root / "packs").rglob("*.pack")) == packs
        with pytest.raises(luopan.IntegrityError, match="cannot verify runs/away"):
            repo.verify()
    os.rename(tmp_path / "unmounted", tmp_path / "disk")
    with luopan.open(root) as repo:
        np.testing.assert_array_equal(repo.load("away")["w"], state(2)["w"])


# -- 2. a run name ending in a newline ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["exp-1\n", "exp\n1", "exp-1\r", "a\0b", "../x", "a/b", "/abs", "..", ".hidden",
                                  "", "x" * 129, "x" * 10_000, "ехр-1", "exp‐1", "exp 1", "exp-1\u200b"])
def test_bad_run_names_are_refused_before_any_write(root, name):
    repo = luopan.open(root)
    with pytest.raises(luopan.InvalidNameError, match="invalid run name"):
        repo.save(name, 1, state(1))
    with pytest.raises(luopan.InvalidNameError):
        repo.load(name)
    assert not (root / "runs").exists() and not (root / "packs").exists()
    repo.save("exp-1", 1, state(1))
    assert repo.gc(grace=0).manifests == 1  # whole-repository gc still runs
    repo.close()


def test_manifest_naming_a_run_with_a_newline_is_corrupt(root):
    two_checkpoints(root)
    reseal(manifest(root, 2), lambda d: d.update(run=RUN + "\n"))
    with luopan.open(root) as repo, pytest.raises(luopan.CorruptManifestError):
        repo.manifest(RUN, 2)


# -- 3. unlock deletes only lock records --------------------------------------------------------------------------
def test_unlock_deletes_only_files_named_like_lock_records(root, tmp_path):
    two_checkpoints(root)
    outside = tmp_path / "elsewhere"
    (outside / "sub").mkdir(parents=True)
    (outside / "notes.json").write_text("{}")
    (outside / "sub" / "x.json").write_text("[]")
    shutil.rmtree(root / "locks", ignore_errors=True)
    os.symlink(outside, root / "locks")
    (outside / "shared-0123456789abcdef.json").write_text("damaged")  # named like a record: a (damaged) lock
    r = cli("unlock", "--all", "-r", root)
    assert r.exit_code == 0, r.output
    assert "1 lock(s) removed" in r.output
    assert sorted(p.name for p in outside.rglob("*")) == ["notes.json", "sub", "x.json"]


def test_a_stray_json_under_locks_does_not_block_saves(root):
    two_checkpoints(root)
    (root / "locks" / "notes").mkdir(parents=True)
    (root / "locks" / "notes" / "x.json").write_text("{}")
    (root / "locks" / "README.json").write_text("{}")
    with luopan.open(root, lock_timeout=2) as repo:
        repo.save(RUN, 3, state(3))
        repo.prune(RUN, KeepLast(2))
        assert list_locks(repo.store) == []


def test_a_damaged_lock_record_fails_fast_and_unlock_removes_it(root):
    two_checkpoints(root)
    (root / "locks").mkdir(exist_ok=True)
    (root / "locks" / "exclusive-00000000000000aa.json").write_bytes(b'{"garbage": 1}')
    with luopan.open(root, lock_timeout=600) as repo, pytest.MonkeyPatch.context() as mp:
        import time
        from types import SimpleNamespace

        from luopan.repository import locks as locks_module

        def no_wait(seconds):
            raise AssertionError("the save waited for a damaged lock record")

        # fails at once, never waiting out the 600 s timeout: nobody but unlock removes a damaged record
        mp.setattr(locks_module, "time", SimpleNamespace(time=time.time, monotonic=time.monotonic, sleep=no_wait))
        with pytest.raises(luopan.LockedError, match="damaged lock record"):
            repo.save(RUN, 3, state(3))
        assert repo.prune(RUN, KeepLast(1), dry_run=True).remove == [1]  # dry runs take no lock
    r = cli("unlock", "-r", root)
    assert r.exit_code == 0 and "1 lock(s) removed" in r.output


@pytest.mark.parametrize("when", [1e12, float("inf"), -1.0, "1e400"])
def test_lock_records_with_absurd_times_are_damaged_not_tracebacks(root, when):
    two_checkpoints(root)
    (root / "locks").mkdir(exist_ok=True)
    rec = {"format_version": 1, "kind": "shared", "op": "save", "host": "h", "pid": 1, "pidns": "", "boot": "",
           "machine": "", "started": None, "created": 0.0, "refreshed": 0.0}
    if isinstance(when, float) and when != float("inf"):  # a properly sealed record dated year 33658 (or -1)
        data = seal({**rec, "created": when, "refreshed": when})
    else:  # inf / 1e400 cannot be sealed as canonical JSON: the record is damaged
        data = seal(rec).replace(b'"created":0.0', b'"created":' + str(when).encode())
    (root / "locks" / "shared-00000000000000bb.json").write_bytes(data)
    for args in (["locks"], ["locks", "--json"], ["gc", "--dry-run"], ["unlock"]):
        r = cli(*args, "-r", root)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        assert r.exit_code == 0, (args, r.output)
    assert list_locks(luopan.open(root).store) == []


# -- 4. prune with a metric no checkpoint records ------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["1:loss:mni", "1:Loss", "1:los"])
def test_prune_keep_best_with_an_unknown_metric_is_an_error(root, rule):
    two_checkpoints(root, loss=[0.1, 0.9], acc=[0.5, 0.6])
    for dry in ([], ["--dry-run"]):
        r = cli("prune", RUN, "--keep-best", rule, *dry, "-r", root)
        assert r.exit_code == 2, r.output
        assert "acc, loss" in r.output and "Nothing was removed" in r.output
    assert luopan.open(root).steps(RUN) == [1, 2]
    r = cli("prune", RUN, "--keep-best", "1:loss:min", "-r", root)
    assert r.exit_code == 0 and luopan.open(root).steps(RUN) == [1, 2]  # step 1 is the best, 2 the newest


def test_prune_api_refuses_an_unknown_metric_and_manager_tolerates_a_late_one(root):
    two_checkpoints(root, loss=[0.1, 0.9])
    with luopan.open(root) as repo:
        with pytest.raises(luopan.LuopanError, match="'Loss'.*they record: loss.*did you mean 'loss'"):
            repo.prune(RUN, KeepBest(1, "Loss"))
        assert repo.prune(RUN, KeepBest(1, "val_loss"), missing_metrics="ignore").remove == [1]


# -- 5. two leaves, one key path ----------------------------------------------------------------------------------
def test_two_leaves_sharing_a_key_path_are_refused_naming_both(root):
    a, b = np.ones(3, np.float32), np.zeros(3, np.float32)
    with luopan.open(root) as repo:
        with pytest.raises(luopan.UnsupportedValueError, match=r"'x'.*state\[''\]\['x'\] and state\['x'\]"):
            repo.save(RUN, 1, {"": {"x": a}, "x": b})
        assert repo.steps(RUN) == []
        repo.save(RUN, 1, {"x": b, "y": {"": a}})  # an empty key below the root is its own path ("y/")
        with pytest.raises(luopan.UnsupportedValueError, match="share the key path"):
            repo.load_into(RUN, {"": {"x": a}, "x": b})
        got = repo.load(RUN)
        np.testing.assert_array_equal(got["y"][""], a)


# -- 6. hostile numbers -------------------------------------------------------------------------------------------
def _set_chunk(offset=None, length=None, codec=None):
    def edit(doc):
        row = doc["entries"][0]["chunks"][0]
        if offset is not None:
            row[2] = offset
        if length is not None:
            row[3] = length
            if codec is not None:
                row[5] = codec
    return edit


@pytest.mark.parametrize("edit,match", [
    (_set_chunk(offset=2**63), "schema"),
    (_set_chunk(offset=2**70), "schema"),
    (lambda d: d["entries"][0].update(shape=[0, 2**64], nbytes=0), "schema"),
    (lambda d: d["entries"][0].update(shape=[1] * 101), "schema"),
    (lambda d: d["entries"][0].update(shape=[0, 2**47, 2**47], nbytes=0, chunks=[]), "cannot be allocated"),
    (lambda d: d.update(step=2**63), "schema"),
    (lambda d: d["stats"].update(chunks=2**64), "schema"),
    (lambda d: d.update(created="yesterday"), "ISO-8601"),
    (lambda d: d["metrics"].update(loss=[1, 2]), "schema"),
])
def test_hostile_numbers_in_a_sealed_manifest_are_refused(root, edit, match):
    two_checkpoints(root)
    reseal(manifest(root, 2), edit)
    with luopan.open(root) as repo:
        with pytest.raises(luopan.CorruptManifestError, match=match):
            repo.load(RUN, 2)
        with pytest.raises(luopan.IntegrityError) as info:
            repo.verify()
        assert len(info.value.problems) == 1  # reported, and step 1 was still verified
        assert info.value.report.checkpoints == 2
    r = cli("verify", "-r", root)
    assert r.exit_code == 3 and "00000002.json" in r.output


def test_a_chunk_beyond_its_pack_is_refused_before_it_is_read(root):
    """A zstd row declaring 900 MiB inside the bounds but past the pack's end: refused by the pack's real size,
    without allocating what it declares."""
    two_checkpoints(root)

    def edit(doc):
        e = doc["entries"][0]
        row = e["chunks"][0]
        row[3], row[4], row[5] = 900 << 20, 900 << 20, "zstd"
        e["chunks"] = [row]
        e["shape"], e["nbytes"] = [225 << 20], 900 << 20
    reseal(manifest(root, 2), edit)
    with luopan.open(root) as repo:
        repo.manifest(RUN, 2)  # sizes agree with each other: only the pack's size shows the lie
        tracemalloc.start()
        try:
            with pytest.raises(luopan.CorruptPackError, match="needs bytes up to"):
                repo.load(RUN, 2)
            with pytest.raises(luopan.IntegrityError, match="needs bytes up to"):
                repo.verify(RUN, 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20


@pytest.mark.parametrize("edit", [
    lambda d: d.update(chunk_size=8192.0), lambda d: d.update(chunk_size=True), lambda d: d.update(pack_size=2**70),
    lambda d: d.update(compression={"codec": "zstd", "level": "3"}), lambda d: d.update(compression="zstd"),
    lambda d: d.update(repo_id=7)])
def test_config_with_wrong_types_is_damaged_at_open(root, edit):
    luopan.open(root).close()
    reseal(root / "luopan.json", edit)
    with pytest.raises(luopan.CorruptRepoError, match="luopan.json|repository config"):
        luopan.open(root)
    r = cli("ls", "-r", root)
    assert r.exit_code == 3 and r.exception is None or isinstance(r.exception, SystemExit)


# -- 7. filesystem errors other than disk-full --------------------------------------------------------------------
needs_modes = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes in-process; the CLI matrix "
                                 "(test_cli_matrix.py) covers these cases as root through setpriv")


@needs_modes
def test_unreadable_pack_is_a_typed_error_and_verify_carries_on(root):
    two_checkpoints(root)
    with luopan.open(root) as repo:
        pack = root / "packs" / repo.manifest(RUN, 2).packs[0][:2] / (repo.manifest(RUN, 2).packs[0] + ".pack")
    os.chmod(pack, 0)
    try:
        with luopan.open(root) as repo:
            with pytest.raises(luopan.StorageError, match="permission denied"):
                repo.load(RUN, 2)
            with pytest.raises(luopan.IntegrityError) as info:
                repo.verify()
            assert any(isinstance(p, luopan.UnreadableError) for p in info.value.problems)
    finally:
        os.chmod(pack, 0o644)


@needs_modes
def test_read_only_repository_gives_typed_errors(root):
    two_checkpoints(root)
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            os.chmod(os.path.join(d, n), 0o555 if n in dirs else 0o444)
    os.chmod(root, 0o555)
    try:
        with luopan.open(root) as repo:
            assert repo.load(RUN)["b"][0] == 2
            with pytest.raises(luopan.StorageError, match="permission denied"):
                repo.save(RUN, 3, state(3))
            assert repo.prune(RUN, KeepLast(1), dry_run=True).remove == [1]
    finally:
        for d, dirs, files in os.walk(root):
            for n in dirs + files:
                os.chmod(os.path.join(d, n), 0o755)
        os.chmod(root, 0o755)


def test_errors_of_the_store_are_storage_errors(root):
    """Mapping done by LocalStore itself (independent of who runs the test): a path through a file, a directory
    where an object should be, an object written where a directory is."""
    two_checkpoints(root)
    store = luopan.open(root).store
    with pytest.raises(luopan.store.KeyNotFound):
        store.get("runs")  # a directory is not an object
    with pytest.raises(luopan.store.KeyNotFound):
        store.get("luopan.json/x")  # a path through a file
    with pytest.raises(luopan.StorageError, match="cannot write runs"):
        store.put("runs", b"x")
    assert isinstance(luopan.StorageError(13, "x"), OSError)


# -- 8. a lock leaked by an outage --------------------------------------------------------------------------------
def test_a_failed_release_is_retried_until_the_store_answers(root):
    """A store that refuses the lock record's delete (an outage as the save fails): the record is deleted in the
    background once the store answers again, so prune/gc are not blocked behind a save that already failed."""
    from luopan.repository.locks import acquire, retry_releases
    from luopan.store import LocalStore

    class Flaky(LocalStore):
        down = False

        def delete(self, key):
            if self.down:
                raise luopan.StorageError(5, "the store does not answer")
            super().delete(key)

    luopan.open(root).close()
    store = Flaky(root)
    lock = acquire(store, "shared", "save")
    store.down = True
    with pytest.warns(UserWarning, match="retrying in the background"):
        lock.release()
    assert [r.key for r in list_locks(store)] == [lock.key]
    store.down = False
    import time

    deadline = time.monotonic() + 10
    while list_locks(store) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list_locks(store) == [] and retry_releases() == 0
    acquire(store, "exclusive", "gc", timeout=1).release()


# -- 10. stray entries under runs/ --------------------------------------------------------------------------------
def test_stray_entries_under_runs_are_skipped_and_reported(root, tmp_path):
    two_checkpoints(root)
    shutil.copytree(root / "runs" / RUN, root / "runs" / "a copy")
    (root / "runs" / ".git").mkdir()
    (root / "runs" / ".git" / "config").write_text("[core]\n")
    (root / "runs" / "notes.txt").write_text("hi")
    ckpt = root / "runs" / RUN / "ckpt"
    (ckpt / "1000000000000000.json").write_text("{}")
    (ckpt / "00000003.json.bak").write_text("{}")
    os.mkfifo(ckpt / "00000004.json")
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", ckpt / "00000005.json")
    with luopan.open(root) as repo:
        assert repo.runs() == [RUN] and repo.steps(RUN) == [1, 2]
        keys = {s.key for s in repo.strays()}
        assert {"runs/a copy/", "runs/.git/", "runs/notes.txt", f"runs/{RUN}/ckpt/1000000000000000.json",
                f"runs/{RUN}/ckpt/00000003.json.bak", f"runs/{RUN}/ckpt/00000004.json"} <= keys
        report = repo.verify()
        assert report.ok and report.checkpoints == 2 and len(report.strays) >= 6
        assert repo.du()["checkpoints"] == 2
        assert repo.gc(grace=0).manifests == 2
        with pytest.raises(luopan.CheckpointNotFoundError):
            repo.load(RUN, 4)  # the FIFO is not a checkpoint, and it is never opened
    for args in (["ls"], ["verify"], ["du"], ["gc", "--dry-run"]):
        r = cli(*args, "-r", root)
        assert r.exit_code == 0, (args, r.output)


# -- 9. stray object keys on S3 (moto) are in test_store_s3.py; 11. CLI tracebacks -----------------------------------
def test_cli_export_to_a_missing_directory_or_onto_a_directory(root, tmp_path):
    two_checkpoints(root)
    r = cli("export", RUN, "-o", tmp_path / "missing" / "m.safetensors", "-r", root)
    assert r.exit_code == 1 and "does not exist" in r.output and r.exception is None or \
        isinstance(r.exception, SystemExit)
    r = cli("export", RUN, "-o", tmp_path, "-r", root)
    assert r.exit_code == 1 and "is a directory" in r.output
    assert not list(tmp_path.glob("*.tmp-*"))


def test_cli_repository_argument_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args, code, match in ((["ls", "-r", f], 4, "is a file"), (["init", "-r", f], 1, "is a file"),
                              (["init", "-r", "s3://"], 2, "needs a bucket"),
                              (["init", "-r", "s3:///x/../y"], 2, "needs a bucket")):  # usage errors (InvalidNameError)
        r = cli(*args)
        assert r.exit_code == code and match in r.output, (args, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit)


# -- smaller gaps -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["pin", "record", "eval", "ref"])
def test_verify_reports_a_damaged_pin_record_eval_or_ref(root, target):
    two_checkpoints(root)
    with luopan.open(root) as repo:
        repo.run(RUN).pin(1, "keep")
        repo.run(RUN).log_eval(2, {"acc": 1.0})
    path = {"pin": root / "refs" / "pins" / RUN / "00000001.json", "record": root / "runs" / RUN / "record.json",
            "eval": root / "runs" / RUN / "evals" / "00000002.json",
            "ref": root / "refs" / "runs" / RUN / "latest.json"}[target]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    r = cli("verify", "-r", root)
    assert r.exit_code == 3 and path.name in r.output, r.output
    r = cli("verify", RUN, "-r", root)
    assert r.exit_code == 3


def test_masked_arrays_are_refused(root):
    with luopan.open(root) as repo, pytest.raises(luopan.UnsupportedValueError, match="masked array.*'m'"):
        repo.save(RUN, 1, {"m": np.ma.masked_array([1.0, 2.0], mask=[False, True])})


@pytest.mark.parametrize("value,match", [
    ({"s": "a\ud800"}, r"lone surrogate.*key path 's'"),
    ({"d": {"k\udc80": 1}}, r"lone surrogate.*'d/k"),
    ({"n": [1, 1 << 20000]}, r"int of 20001 bits.*key path 'n/1'"),
])
def test_refusals_name_the_key_path(root, value, match):
    with luopan.open(root) as repo, pytest.raises(luopan.UnsupportedValueError, match=match):
        repo.save(RUN, 1, value)


def test_json_files_are_capped_before_they_are_read(root, monkeypatch):
    """A manifest larger than any valid one is refused from its size, not read whole (docs/format.md §11)."""
    two_checkpoints(root)
    import luopan.checkpoint.reading as repo_module

    monkeypatch.setattr(repo_module, "MAX_MANIFEST_BYTES", 512)  # the manifest is a ~0.9 KiB zstd frame (§4)
    path = manifest(root, 2)
    assert path.stat().st_size > 512
    with luopan.open(root) as repo:
        with pytest.raises(luopan.ObjectTooLargeError, match="more than any valid"):
            repo.manifest(RUN, 2)
    with open(path, "r+b") as f:  # a sparse 3 GiB "manifest": refused without reading it
        f.truncate(3 << 30)
    monkeypatch.undo()
    tracemalloc.start()
    try:
        with luopan.open(root) as repo, pytest.raises(luopan.ObjectTooLargeError):
            repo.manifest(RUN, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_restore_falls_back_past_a_damaged_newest_checkpoint(root):
    torch = pytest.importorskip("torch")
    from luopan.torch import CheckpointManager, TrainingState

    model = torch.nn.Linear(4, 3)
    with CheckpointManager(root, RUN, TrainingState(model=model)) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step)
    with luopan.open(root) as repo:
        newest_only = set(repo.manifest(RUN, 3).packs) - set(repo.manifest(RUN, 2).packs)
    pack = sorted(newest_only)[0]
    (root / "packs" / pack[:2] / f"{pack}.pack").unlink()
    fresh = torch.nn.Linear(4, 3)
    mgr = CheckpointManager(root, RUN, TrainingState(model=fresh))
    with pytest.warns(UserWarning, match="skipped checkpoint step 3"):
        assert mgr.restore() == 2
    assert [s for s, _ in mgr.restore_skipped] == [3]
    assert torch.equal(fresh.weight, torch.full((3, 4), 2.0))
    with pytest.raises(luopan.MissingPackError):
        mgr.restore(3)  # a specific step: never a silent fallback
    with torch.no_grad():
        fresh.weight.zero_()
    mgr.close()


@pytest.mark.parametrize("step", [True, 1.0, -1, 2**63, 10**15, "1", None, np.float32(1)])
def test_bad_steps_are_refused(root, step):
    with luopan.open(root) as repo, pytest.raises(luopan.InvalidNameError, match="invalid step"):
        repo.save(RUN, step, state(1))


def test_numpy_and_torch_integer_steps_are_steps(root):
    torch = pytest.importorskip("torch")
    with luopan.open(root) as repo:
        repo.save(RUN, np.int64(3), state(3))
        repo.save(RUN, torch.tensor(4), state(4))
        assert repo.steps(RUN) == [3, 4]
        assert unseal(inflate_json(manifest(root, 4).read_bytes()))["step"] == 4
        assert repo.load(RUN, np.uint8(3))["b"][0] == 3


def test_pin_tags_are_validated(root):
    two_checkpoints(root)
    with luopan.open(root) as repo:
        for tag in ("", "a\nb", "x" * 129, "a\0", "\ud800"):
            with pytest.raises(luopan.InvalidNameError, match="invalid tag"):
                repo.run(RUN).pin(1, tag)
        repo.run(RUN).pin(1, "release 1 ✓")
        assert repo.run(RUN).pins()[1]["tag"] == "release 1 ✓"


# -- found in review ------------------------------------------------------------------------------------------------
def test_gc_refuses_when_runs_itself_is_a_dangling_link(root, tmp_path):
    """`runs` moved to another disk and linked back, the disk not mounted: gc must not see "no checkpoints"."""
    two_checkpoints(root)
    _move_to_an_unmounted_disk(root / "runs", tmp_path)
    with luopan.open(root) as repo:
        packs = sorted((root / "packs").rglob("*.pack"))
        with pytest.raises(luopan.GcError, match="runs: a dangling symbolic link"):
            repo.gc(grace=0)
        assert sorted((root / "packs").rglob("*.pack")) == packs
        assert [s.key for s in repo.strays() if s.unreadable] == ["runs"]


def test_run_names_with_the_temp_mark_are_refused_and_old_ones_kept_by_gc(root):
    """`.tmp-` marks temporary files, which every walk skips: a run named so would be invisible to gc."""
    with luopan.open(root, chunk_size=4096) as repo:
        with pytest.raises(luopan.InvalidNameError, match=".tmp-"):
            repo.save("exp.tmp-1", 1, state(1))
    two_checkpoints(root, run="exp")  # a run saved by an older luopan under such a name:
    os.rename(root / "runs" / "exp", root / "runs" / "exp.tmp-1")
    with luopan.open(root) as repo:
        assert repo.runs() == []
        assert any(s.key == "runs/exp.tmp-1/" for s in repo.strays())
        report = repo.gc(grace=0)
        assert report.stray_manifests == 2 and report.deleted_packs == 0  # what it names is kept
    os.rename(root / "runs" / "exp.tmp-1", root / "runs" / "exp")
    with luopan.open(root) as repo:
        assert repo.verify().ok
        np.testing.assert_array_equal(repo.load("exp")["w"], state(2)["w"])


def test_stray_copies_of_a_run_keep_their_data_through_gc(root):
    """A run directory renamed to an invalid name is not a checkpoint, but gc keeps what its manifests name."""
    two_checkpoints(root)
    os.rename(root / "runs" / RUN, root / "runs" / f"{RUN} (old)")
    with luopan.open(root) as repo:
        assert repo.runs() == []
        assert repo.gc(grace=0, repack_below=1.0).deleted_packs == 0
    os.rename(root / "runs" / f"{RUN} (old)", root / "runs" / RUN)
    with luopan.open(root) as repo:
        assert repo.verify().ok


def test_an_unreadable_lock_record_is_never_broken_as_stale(root):
    """A lock record that cannot be read right now (permissions, a 503) may be a live holder's: `unlock` (stale only)
    keeps it, and a locker waits for it instead of failing at once."""
    from luopan.repository.locks import acquire, break_locks
    from luopan.store import LocalStore

    class Unreadable(LocalStore):
        def get_limited(self, key, limit):
            if key.startswith("locks/"):
                raise luopan.StorageError(13, f"permission denied: cannot read {key}")
            return super().get_limited(key, limit)

    luopan.open(root).close()
    held = acquire(LocalStore(root), "exclusive", "gc")
    store = Unreadable(root)
    assert [r.stale_reason() for r in list_locks(store)] == [None]
    assert break_locks(store, stale_only=True) == []
    with pytest.raises(luopan.LockedError, match="unreadable"):
        acquire(store, "shared", "save", timeout=0.5)
    held.release()


def test_link_trees_do_not_make_walks_explode(root, tmp_path):
    """Each level holding two links to the next: 2^30 paths if every alias were walked. Each directory is walked
    once; the second name of a directory is reported (unreadable: which name is meant is ambiguous). A link to /
    where luopan keeps no directories is never walked."""
    two_checkpoints(root)
    level = tmp_path / "l0"
    level.mkdir()
    top = level
    for i in range(1, 31):
        nxt = tmp_path / f"l{i}"
        nxt.mkdir()
        os.symlink(nxt, level / "a")
        os.symlink(nxt, level / "b")
        level = nxt
    os.symlink(top, root / "runs" / RUN / "tree")
    os.makedirs(root / "locks", exist_ok=True)
    os.symlink("/", root / "locks" / "everything")  # never walked: lock records are directly in locks/
    listed = []  # the work, not the time: directories listed (a walk of / would list tens of thousands)
    with pytest.MonkeyPatch.context() as mp:
        real = os.scandir
        mp.setattr(os, "scandir", lambda path=".": (listed.append(path), real(path))[1])
        with luopan.open(root) as repo:
            assert repo.steps(RUN) == [1, 2]
            assert any("two names for one directory" in s.reason for s in repo.strays())
            assert list_locks(repo.store) == []
            with pytest.raises(luopan.GcError, match="two names for one directory"):
                repo.gc(grace=0)
    assert 0 < len(listed) < 400, len(listed)


def test_a_fifo_named_like_a_temporary_file_does_not_hang_open(root):
    two_checkpoints(root)
    os.mkfifo(root / "packs" / "x.pack.tmp-otherhost-1-abcd")
    os.mkfifo(root / "luopan.json.tmp-vm-99999999999999999999-abcd")
    with luopan.open(root) as repo:  # cleanup of temporaries skips what is not a regular file
        assert repo.steps(RUN) == [1, 2]
    assert (root / "packs" / "x.pack.tmp-otherhost-1-abcd").exists()


@pytest.mark.parametrize("value,match", [
    ({"k" * 70_000: np.ones(2)}, "key path of 70000 characters"),
    ({"e": np.empty((0, 2**50), np.float32)}, "limited to 2"),
])
def test_saves_the_reader_would_refuse_are_refused(root, value, match):
    with luopan.open(root) as repo:
        with pytest.raises(luopan.UnsupportedValueError, match=match):
            repo.save(RUN, 1, value)
        repo.save(RUN, 1, {"k" * 60_000: np.ones(2), "e": np.empty((0, 2**40), np.float32)})
        assert repo.load(RUN)["e"].shape == (0, 2**40)


def test_after_a_fallback_the_loop_saves_the_damaged_step_again(root):
    torch = pytest.importorskip("torch")
    from luopan.policies import EveryNSteps
    from luopan.torch import CheckpointManager, TrainingState

    model = torch.nn.Linear(2, 2)
    with CheckpointManager(root, RUN, TrainingState(model=model), policy=EveryNSteps(10)) as mgr:
        for step in (10, 20):
            mgr.save(step)
    m = manifest(root, 20)
    m.write_bytes(m.read_bytes()[:-10])  # damaged
    mgr = CheckpointManager(root, RUN, TrainingState(model=model), policy=EveryNSteps(10))
    with pytest.warns(UserWarning, match="skipped checkpoint step 20"):
        assert mgr.restore() == 10
    for step in range(11, 21):
        mgr.maybe_save(step)  # step 20 replaces the damaged checkpoint instead of raising CheckpointExistsError
    mgr.close()
    with luopan.open(root) as repo:
        assert repo.steps(RUN) == [10, 20] and repo.verify().ok

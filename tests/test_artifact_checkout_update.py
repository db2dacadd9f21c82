"""Artifacts the DVC way (issue 31): ``checkout`` into an existing folder updates it in place — only files that differ
are written, files of the previous checkout the version lacks go, local edits are refused without ``force`` —
``status`` says how a folder differs from its version, ``diff`` how two versions differ. Real files, real folders;
a crash mid-checkout (process kill, and every power-loss state the durability model allows) leaves each file old or
new and a rerun finishes it."""

from __future__ import annotations

import fcntl
import os
import subprocess

import numpy as np
import pytest

import luopan
from luopan.artifact.ownfiles import RECORD

from .conftest import PYTHON
from .crashstates import CrashState, check_crash_states
from .powerloss import Recorder


def files_of(root):
    """{relative path: bytes} of the files under root, but luopan's own (the record, temporary files)."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel != RECORD and not name.startswith(".luopan-tmp-") and not rel.startswith(RECORD + ".tmp-"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[rel] = f.read()
    return out


def version_files(seed):
    rng = np.random.default_rng(seed)
    return {"big.bin": rng.bytes(700_000), "train/part-0.jsonl": b'{"id": 0}\n' * 5000,
            "train/part-1.jsonl": b'{"id": 1}\n' * 5000, "notes.txt": b"v1\n", "gone/old.txt": b"old\n",
            "empty": b""}


V1 = version_files(1)
V2 = {**{k: v for k, v in V1.items() if k != "gone/old.txt"},
      "train/part-1.jsonl": b'{"id": 1, "fixed": true}\n' * 5000, "notes.txt": b"v2\n", "new/added.bin": b"x" * 3000}


@pytest.fixture
def art(tmp_path):
    repo = luopan.open(tmp_path / "repo")
    a = repo.artifact("datasets/clean")
    a.commit(V1)
    a.commit(V2, parents=["datasets/clean@1"])
    yield a
    repo.close()


def stats(root, paths):
    return {p: (os.stat(os.path.join(root, p)).st_ino, os.stat(os.path.join(root, p)).st_mtime_ns) for p in paths}


# -- in place -----------------------------------------------------------------------------------------------------
def test_an_existing_folder_is_updated_in_place_writing_only_what_differs(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    assert files_of(co) == V1 and (co / RECORD).exists()
    same = [p for p in V2 if V1.get(p) == V2[p]]
    before = stats(co, same + ["notes.txt"])
    seen = []
    assert art.checkout(co, 2, progress=seen.append) == str(co)
    assert files_of(co) == V2
    assert not (co / "gone").exists()  # the version's directory went with its only file
    assert stats(co, same) == {p: before[p] for p in same}  # unchanged files untouched: same inode, same mtime
    assert stats(co, ["notes.txt"])["notes.txt"] != before["notes.txt"]
    assert sum(seen) == art.get(2).logical_bytes  # the bar reaches the version's size
    assert art.status(co).clean and art.status(co).ref == "datasets/clean@2"
    art.checkout(co, 1)  # and back
    assert files_of(co) == V1 and art.status(co).ref == "datasets/clean@1"


def test_local_edits_are_refused_unless_force(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    (co / "notes.txt").write_bytes(b"my notes\n")  # edited; version 2 changes it
    (co / "gone" / "old.txt").write_bytes(b"edited\n")  # edited; version 2 removes it
    (co / "new").mkdir()
    (co / "new" / "added.bin").write_bytes(b"not luopan's")  # untracked, in the way of version 2's file
    (co / "mine.txt").write_bytes(b"untracked, in nobody's way")
    record = (co / RECORD).read_bytes()
    tree = files_of(co)
    with pytest.raises(luopan.CheckoutConflictError, match=r"3 local change.*--force") as caught:
        art.checkout(co, 2)
    assert sorted(caught.value.paths) == ["gone/old.txt", "new/added.bin", "notes.txt"]
    assert "edited since it was checked out" in str(caught.value) and "untracked" in str(caught.value)
    assert files_of(co) == tree and (co / RECORD).read_bytes() == record  # nothing changed
    art.checkout(co, 2, force=True)
    assert files_of(co) == {**V2, "mine.txt": b"untracked, in nobody's way"}  # a file in nobody's way stays
    st = art.status(co)
    assert (st.modified, st.added, st.deleted) == ([], ["mine.txt"], [])


def test_an_edit_of_a_file_the_versions_share_is_refused_too(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    (co / "big.bin").write_bytes(b"edited")
    with pytest.raises(luopan.CheckoutConflictError) as caught:
        art.checkout(co, 2)
    assert caught.value.paths == ["big.bin"]


def test_a_folder_without_a_record_adopts_files_that_already_match(art, tmp_path):
    co = tmp_path / "co"
    (co / "train").mkdir(parents=True)
    (co / "train" / "part-0.jsonl").write_bytes(V2["train/part-0.jsonl"])
    (co / "big.bin").write_bytes(b"something else")
    ino = os.stat(co / "train" / "part-0.jsonl").st_ino
    with pytest.raises(luopan.CheckoutConflictError) as caught:
        art.checkout(co)
    assert caught.value.paths == ["big.bin"]
    (co / "big.bin").unlink()
    art.checkout(co)
    assert files_of(co) == V2 and os.stat(co / "train" / "part-0.jsonl").st_ino == ino


def test_a_file_becomes_a_directory_and_back(tmp_path):
    with luopan.open(tmp_path / "repo") as repo:
        a = repo.artifact("t")
        a.commit({"x": b"a file", "y/z": b"z"})
        a.commit({"x/inner.txt": b"inner", "y": b"now a file"})
        co = tmp_path / "co"
        a.checkout(co, 1)
        a.checkout(co, 2)
        assert files_of(co) == {"x/inner.txt": b"inner", "y": b"now a file"}
        a.checkout(co, 1)
        assert files_of(co) == {"x": b"a file", "y/z": b"z"}
        (co / "y" / "mine").write_bytes(b"mine")  # a directory holding a file of its own, where 2 has a file
        with pytest.raises(luopan.CheckoutConflictError, match="a directory with files of its own"):
            a.checkout(co, 2)
        a.checkout(co, 2, force=True)
        assert files_of(co) == {"x/inner.txt": b"inner", "y": b"now a file"}


def test_a_link_in_the_way_is_never_followed(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    target = tmp_path / "elsewhere.txt"
    target.write_bytes(b"outside")
    (co / "notes.txt").unlink()
    os.symlink(target, co / "notes.txt")
    with pytest.raises(luopan.CheckoutConflictError, match="symbolic link"):
        art.checkout(co, 2)
    art.checkout(co, 2, force=True)
    assert target.read_bytes() == b"outside" and not os.path.islink(co / "notes.txt")
    assert files_of(co) == V2


def test_one_checkout_at_a_time_per_folder(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    fd = os.open(co, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(luopan.LockedError, match="another checkout"):
            art.checkout(co, 2)
    finally:
        os.close(fd)
    assert files_of(co) == V1


def test_a_damaged_record_is_refused_unless_force(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 1)
    (co / RECORD).write_bytes(b"{garbage")
    with pytest.raises(luopan.IntegrityError, match="--force"):
        art.checkout(co, 2)
    with pytest.raises(luopan.IntegrityError, match="not a checkout record"):
        art.status(co)
    art.checkout(co, 2, force=True)  # without a record every file is untracked: one in nobody's way stays
    assert files_of(co) == {**V2, "gone/old.txt": b"old\n"} and art.status(co).added == ["gone/old.txt"]


# -- status and diff -------------------------------------------------------------------------------------------------
def test_status_lists_modified_added_and_deleted_files(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 2)
    st = art.status(co)
    assert st.clean and (st.modified, st.added, st.deleted) == ([], [], [])
    (co / "notes.txt").write_bytes(b"v2\n+ an edit\n")
    (co / "train" / "part-0.jsonl").unlink()
    (co / "train" / "part-2.jsonl").write_bytes(b"new")
    st = art.status(co)
    assert not st.clean and st.ref == "datasets/clean@2" and st.path == str(co)
    assert (st.modified, st.added, st.deleted) == (["notes.txt"], ["train/part-2.jsonl"], ["train/part-0.jsonl"])
    old = art.status(co, 1)  # against another version
    assert old.ref == "datasets/clean@1" and "gone/old.txt" in old.deleted and "new/added.bin" in old.added
    # an edit that keeps the size and the mtime is still found (content, not stat, decides)
    before = os.stat(co / "big.bin")
    data = bytearray((co / "big.bin").read_bytes())
    data[1000] ^= 1
    (co / "big.bin").write_bytes(bytes(data))
    os.utime(co / "big.bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert "big.bin" in art.status(co).modified


def test_status_needs_a_version_where_the_folder_has_no_record_of_this_artifact(art, tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(luopan.UsageError, match="no checkout record"):
        art.status(tmp_path / "plain")
    assert art.status(tmp_path / "plain", 2).deleted == sorted(V2)
    with luopan.open(str(tmp_path / "repo")) as repo:
        repo.artifact("other").commit({"a": b"a"})
        repo.artifact("other").checkout(tmp_path / "o")
    with pytest.raises(luopan.UsageError, match="checkout of other@1, not of datasets/clean"):
        art.status(tmp_path / "o")
    with pytest.raises(luopan.UsageError, match="not a folder"):
        art.status(tmp_path / "missing")


def test_diff_lists_files_added_removed_and_modified_with_sizes(art):
    d = art.diff(1, 2)
    assert (d.a, d.b) == ("datasets/clean@1", "datasets/clean@2") and not d.same
    assert [(c.path, c.size_a, c.size_b) for c in d.added] == [("new/added.bin", None, 3000)]
    assert [(c.path, c.size_a, c.size_b) for c in d.removed] == [("gone/old.txt", 4, None)]
    assert [(c.path, c.size_a, c.size_b) for c in d.modified] == [
        ("notes.txt", 3, 3), ("train/part-1.jsonl", len(V1["train/part-1.jsonl"]), len(V2["train/part-1.jsonl"]))]
    assert d.unchanged == 3
    assert art.diff(2, "datasets/clean@2").same and art.diff(1).b == "datasets/clean@2"  # latest by default
    with pytest.raises(luopan.ArtifactNotFoundError):
        art.diff(1, 9)


def test_a_checked_out_folder_commits_without_its_record(art, tmp_path):
    co = tmp_path / "co"
    art.checkout(co, 2)
    (co / "notes.txt").write_bytes(b"v3\n")
    v3 = art.commit(co, parents=["datasets/clean@2"])
    assert RECORD not in v3.files and v3.files == sorted(V2)
    assert art.status(co, 3).clean
    with pytest.raises(luopan.InvalidPathError, match="its own files"):
        art.commit({RECORD: b"{}"})


# -- crashes -------------------------------------------------------------------------------------------------------------
CHILD = r"""
import sys, luopan
with luopan.open(sys.argv[1]) as repo:
    repo.artifact("datasets/clean").checkout(sys.argv[2], int(sys.argv[3]))
"""


def test_a_checkout_killed_midway_leaves_each_file_old_or_new_and_a_rerun_finishes(art, tmp_path, child_env):
    co = tmp_path / "co"
    art.checkout(co, 1)
    env = {**child_env, "LUOPAN_CRASH_AT": "artifact.checkout.file.renamed"}  # right after the first file is placed
    proc = subprocess.run([PYTHON, "-c", CHILD, str(tmp_path / "repo"), str(co), "2"], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == 97, proc.stderr.decode()[-2000:]
    got = files_of(co)
    assert got != V1 and got != V2  # caught midway
    for path in set(V1) | set(V2):
        assert got.get(path) in (V1.get(path), V2.get(path)), path
    st = art.status(co)
    assert not st.complete and st.ref == "datasets/clean@2"
    art.checkout(co, 2)  # no --force needed: every file is the old or the new version's
    assert files_of(co) == V2 and art.status(co).clean and art.status(co).complete
    assert not [n for n in os.listdir(co) if n.startswith(".luopan-tmp-")]


def test_an_in_place_checkout_under_power_loss(tmp_path):
    world = tmp_path / "w"
    with luopan.open(world / "repo", progress=False) as repo:
        a = repo.artifact("ds")
        a.commit(V1)
        a.commit(V2)
        a.checkout(world / "co", 1)

    def op(rec):
        with luopan.open(world / "repo", progress=False) as repo:
            repo.artifact("ds").checkout(world / "co", 2)
        rec.ack("done")

    with Recorder(world) as rec:
        op(rec)
    assert files_of(world / "co") == V2
    finished = []

    def check(state: CrashState) -> None:
        co = os.path.join(state.root, "co")
        got = files_of(co)
        for path in set(V1) | set(V2):
            assert got.get(path) in (V1.get(path), V2.get(path)), f"{path} is neither old nor new"
        if "done" in state.acks:
            assert got == V2, "the checkout returned, and the folder is not version 2"
        with luopan.open(os.path.join(state.root, "repo"), create=False, progress=False) as repo:
            a = repo.artifact("ds")
            a.checkout(co, 2)  # the rerun: never refused, and it finishes
            assert files_of(co) == V2 and a.status(co).clean
        finished.append(state.point)

    assert check_crash_states(rec, tmp_path, check) > 20
    assert len(set(finished)) > 5

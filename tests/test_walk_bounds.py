"""The search for temporary files (cleanup at open and in gc, `luopan doctor`) enters only directories where luopan
writes files (luopan.store.walk.KEY_DIRS): a link planted elsewhere costs one stat, not a walk of what it points at,
and a file there that merely looks like a temporary is never deleted. Linked key directories are still followed."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import luopan
from luopan.doctor.leftovers import temporaries
from luopan.store import walk as walk_module
from luopan.store.walk import walk

DEAD = "x.tmp-otherhost-4242-abcd"  # a temp file of a writer of another host, long gone (no flock held)


@pytest.fixture
def repo_with_links(tmp_path):
    root = tmp_path / "repo"
    with luopan.open(root, chunk_size=4096) as r:
        r.save("r", 1, {"w": np.arange(2000, dtype=np.float32)})
    big = tmp_path / "elsewhere"  # e.g. a home directory someone linked into the repository
    for i in range(300):
        (big / f"d{i}").mkdir(parents=True)
    (big / "d7" / DEAD).write_bytes(b"someone else's file")
    os.symlink(big, root / "locks" / "everything")
    os.symlink(big, root / "runs" / "r" / "elsewhere")
    os.symlink(big, root / "junk")
    # a key directory moved to another disk and linked back: its temporaries are still found
    moved = tmp_path / "other-disk" / "ckpt"
    moved.parent.mkdir()
    os.rename(root / "runs" / "r" / "ckpt", moved)
    os.symlink(moved, root / "runs" / "r" / "ckpt")
    (moved / DEAD).write_bytes(b"half a manifest")
    (root / "packs" / DEAD).write_bytes(b"half a pack")
    for path in (moved / DEAD, root / "packs" / DEAD, big / "d7" / DEAD):  # two days old: certainly abandoned
        os.utime(path, (os.path.getmtime(path) - 2 * 86400,) * 2)
    return root, big, moved


def _record_scandir(monkeypatch, listed):
    """Record the directories this thread lists (another test's background thread may list its own meanwhile)."""
    real, me = os.scandir, threading.get_ident()

    def scandir(path="."):
        if threading.get_ident() == me:
            listed.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)


def test_temporaries_are_searched_only_where_luopan_writes(repo_with_links, monkeypatch):
    root, big, moved = repo_with_links
    listed = []
    real = os.scandir
    _record_scandir(monkeypatch, listed)
    found = [p for p, stray in walk(str(root), "", temporaries=True) if stray is None and ".tmp-" in p]
    assert sorted(os.path.basename(os.path.dirname(p)) for p in found) == ["ckpt", "packs"]
    assert not any(str(big) in p or "everything" in p or "junk" in p or "elsewhere" in p for p in listed)
    assert len(listed) < 30  # the repository's own directories, not the 300 linked in


def test_cleanup_removes_dead_temporaries_in_linked_key_dirs_and_nothing_outside(repo_with_links):
    root, big, moved = repo_with_links
    with luopan.open(root) as r:
        assert r.steps("r") == [1]
    assert not (moved / DEAD).exists() and not (root / "packs" / DEAD).exists()
    assert (big / "d7" / DEAD).read_bytes() == b"someone else's file"  # never luopan's to delete


def test_the_doctor_lists_leftovers_only_where_luopan_writes(repo_with_links):
    root, _big, _moved = repo_with_links
    found = sorted(t.path for t in temporaries(str(root), 0.0))
    assert found == [f"packs/{DEAD}", f"runs/r/ckpt/{DEAD}"]


def test_below_a_followed_link_only_key_directories_are_entered(repo_with_links, monkeypatch):
    root, big, _moved = repo_with_links
    os.symlink(big, root / "runs" / "r2")  # a run directory elsewhere: followed, but only its ckpt/ and evals/
    (big / "ckpt").mkdir()
    (big / "ckpt" / DEAD).write_bytes(b"half a manifest of r2")
    listed = []
    real = os.scandir
    _record_scandir(monkeypatch, listed)
    found = sorted(os.path.relpath(p, root) for p, stray in walk(str(root), "", temporaries=True)
                   if stray is None and ".tmp-" in p)
    assert found == [f"packs/{DEAD}", f"runs/r/ckpt/{DEAD}", f"runs/r2/ckpt/{DEAD}"]
    assert not any(os.path.basename(p).startswith("d") and p[-1:].isdigit() for p in listed)  # none of d0…d299


def test_a_store_s_own_directories_are_all_searched(tmp_path):
    """A LocalStore holds any keys (not only luopan's layout): its real directories are searched, links are not."""
    from luopan.store import LocalStore

    s = LocalStore(str(tmp_path / "s"))
    s.put("any/where/k", b"1")
    (tmp_path / "s" / "any" / "where" / DEAD).write_bytes(b"x")
    os.utime(tmp_path / "s" / "any" / "where" / DEAD, (1, 1))
    assert s.cleanup_temporaries() == 1


@pytest.mark.parametrize("rel,expected", [
    ("", True), ("packs/ab", True), ("packs/ab/cd", False), ("locks", True), ("locks/x", False),
    ("runs/r/ckpt", True), ("runs/r/tree", False), ("artifacts/a/b/c/d/e/f/g/h/_v", True),
    ("artifacts/a/b/c/d/e/f/g/h/i", False), ("refs/pins/_artifacts/a/b", True), ("journals/j/log", True),
    ("journals/j/log/x", False), ("indexes/kb/main/_v", True), ("tier/pending/_indexes/kb/x", True), ("junk", False),
])
def test_the_layout_of_key_directories(rel, expected):
    assert walk_module.may_hold_files(rel) is expected

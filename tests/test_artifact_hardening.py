"""Artifacts against hostile input (issue 27 items 10 and 12, and the run/artifact name clash of the CLI).

- A file swapped after the walk (a symbolic link to an outside file, a FIFO, another file, a directory above it
  swapped for a link) is never followed and never blocks: SourceChangedError naming it, nothing committed.
- One name rule (luopan.format.names.path_problem) for every file name, checked before anything is written:
  InvalidPathError (a UsageError: the CLI exits 2) naming the path escaped. A manifest an older luopan wrote with such
  a name is refused by readers with ManifestNameError, and gc keeps what it references instead of stopping.
- A name that is both a run and an artifact is an error for ls/pin/unpin/prune/verify (exit 2) until --kind says which.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
import luopan.artifact.api as artifact_api
from luopan.artifact import sources
from luopan.cli.main import app
from luopan.format.names import artifact_manifest_key, path_problem, show_path

JOIN_TIMEOUT = 60  # seconds a commit may take before the test calls it hung (it takes milliseconds)


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def repo(tmp_path):
    return luopan.open(tmp_path / "repo")


def _keys(repo):
    return sorted(k for k in repo.store.list("") if not k.startswith(("locks/", "tmp/")))


def _swap_after_walk(monkeypatch, swap):
    """Run ``swap()`` after the commit listed its files and before it opens them."""
    real = artifact_api.collect

    def collect_then_swap(what):
        collected = real(what)
        swap()
        return collected

    monkeypatch.setattr(artifact_api, "collect", collect_then_swap)


# -- item 10: what is opened is what was listed ---------------------------------------------------------------------
def test_a_file_swapped_for_a_link_after_the_walk_is_not_followed(repo, tmp_path, monkeypatch):
    secret = os.urandom(40_000)
    (tmp_path / "outside.key").write_bytes(secret)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"mine")
    (src / "b.txt").write_bytes(b"also mine")
    before = _keys(repo)

    def swap():
        os.unlink(src / "b.txt")
        os.symlink(tmp_path / "outside.key", src / "b.txt")

    _swap_after_walk(monkeypatch, swap)
    with pytest.raises(luopan.SourceChangedError, match="b.txt") as caught:
        repo.artifact("x").commit(src)
    assert "symbolic link" in str(caught.value) and caught.value.path.endswith("b.txt")
    assert repo.artifact("x").numbers() == []
    assert _keys(repo) == before  # the packs written before the swap were taken back
    for key in repo.store.list("packs/"):
        assert secret[:4096] not in repo.store.get(key)


def test_a_fifo_swapped_in_after_the_walk_does_not_block_the_commit(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"data")
    fifo = src / "a.txt"

    def swap():
        os.unlink(fifo)
        os.mkfifo(fifo)

    _swap_after_walk(monkeypatch, swap)
    outcome = {}

    def commit():
        try:
            repo.artifact("x").commit(src)
            outcome["result"] = "committed"
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["result"] = exc

    t = threading.Thread(target=commit, daemon=True)
    t.start()
    t.join(JOIN_TIMEOUT)
    if t.is_alive():  # release a reader blocked on the FIFO so the suite goes on, then fail
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno == errno.ENXIO
        t.join(JOIN_TIMEOUT)
        pytest.fail("the commit blocked on a FIFO swapped in after the walk")
    assert isinstance(outcome["result"], luopan.SourceChangedError), outcome
    assert "FIFO" in str(outcome["result"]) and "a.txt" in str(outcome["result"])
    assert repo.artifact("x").numbers() == []


def test_a_file_replaced_by_another_after_the_walk_is_refused(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"listed")

    def swap():
        (tmp_path / "other").write_bytes(b"not what was listed")
        os.replace(tmp_path / "other", src / "a.txt")

    _swap_after_walk(monkeypatch, swap)
    with pytest.raises(luopan.SourceChangedError, match="another regular file"):
        repo.artifact("x").commit(src)
    assert repo.artifact("x").numbers() == []


def test_a_directory_swapped_for_a_link_after_the_walk_is_not_followed(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.bin").write_bytes(b"inside")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "f.bin").write_bytes(b"OUTSIDE")

    def swap():
        os.rename(src / "sub", tmp_path / "moved")
        os.symlink(elsewhere, src / "sub")

    _swap_after_walk(monkeypatch, swap)
    with pytest.raises(luopan.SourceChangedError, match="f.bin"):
        repo.artifact("x").commit(src)
    assert repo.artifact("x").numbers() == []


def test_a_single_file_swapped_for_a_link_is_not_followed(repo, tmp_path, monkeypatch):
    (tmp_path / "outside").write_bytes(b"secret")
    one = tmp_path / "one.txt"
    one.write_bytes(b"mine")

    def swap():
        os.unlink(one)
        os.symlink(tmp_path / "outside", one)

    _swap_after_walk(monkeypatch, swap)
    with pytest.raises(luopan.SourceChangedError, match="one.txt"):
        repo.artifact("x").commit(one)
    assert repo.artifact("x").numbers() == []


def test_the_walk_lists_a_directory_only_through_the_one_it_checked(tmp_path):
    """A directory swapped for a link (or for another directory) between its listing and its reading is refused."""
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir()
    other.mkdir()
    st = os.lstat(real)
    assert [n for n, _ in sources._list(str(real), (st.st_dev, st.st_ino))] == []
    with pytest.raises(luopan.SourceChangedError, match="another directory"):
        sources._list(str(other), (st.st_dev, st.st_ino))
    os.symlink(other, tmp_path / "link")
    with pytest.raises(luopan.SourceChangedError, match="symbolic link"):
        sources._list(str(tmp_path / "link"), (st.st_dev, st.st_ino))


def test_a_file_that_vanished_after_the_walk_is_named(repo, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "gone.txt").write_bytes(b"x")
    _swap_after_walk(monkeypatch, lambda: os.unlink(src / "gone.txt"))
    with pytest.raises(luopan.SourceChangedError, match="gone.txt.*now gone"):
        repo.artifact("x").commit(src)


def test_a_still_tree_commits_and_checks_out_exactly(repo, tmp_path):
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "deep.bin").write_bytes(os.urandom(3 << 20))
    (src / "top.txt").write_bytes(b"top")
    v = repo.artifact("x").commit(src)
    assert v.files == ["d/e/deep.bin", "top.txt"] and v.dirs == ["d", "d/e"]
    out = repo.artifact("x").checkout(tmp_path / "out")
    assert (tmp_path / "out" / "d" / "e" / "deep.bin").read_bytes() == (src / "d" / "e" / "deep.bin").read_bytes()
    assert os.path.basename(out) == "out"


# -- item 12: one name rule, before anything is written ---------------------------------------------------------------
BAD_NAMES = [b"bad\nname", b"back\\slash", b"ctl\x01", b"esc\x1b[31m", b"del\x7f", b"\xff\xfe-not-utf8",
             "c1-\x85".encode(), "sep\u2028".encode()]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_single_file_with_a_bad_name_is_refused_before_anything_is_written(repo, tmp_path, name):
    path = os.path.join(os.fsencode(tmp_path), name)
    with open(path, "wb") as f:
        f.write(b"data")
    before = _keys(repo)
    with pytest.raises(luopan.InvalidPathError) as caught:
        repo.artifact("x").commit(os.fsdecode(path))
    assert isinstance(caught.value, luopan.UsageError) and isinstance(caught.value, luopan.UnsupportedFileError)
    message = str(caught.value)
    assert "\n" not in message and "\x1b" not in message and "rename it" in message
    assert show_path(os.fsdecode(path)) in message
    assert _keys(repo) == before and repo.artifact("x").numbers() == []


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_file_with_a_bad_name_in_a_directory_is_refused(repo, tmp_path, name):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"fine")
    with open(os.path.join(os.fsencode(src), name), "wb") as f:
        f.write(b"data")
    before = _keys(repo)
    with pytest.raises(luopan.InvalidPathError, match="rename it"):
        repo.artifact("x").commit(src)
    assert _keys(repo) == before


@pytest.mark.parametrize("key", ["c1\x85", "ls\u2028", "\udcff", "a\x00b", "x" * 5000, "a/./b", b"bytes-key", 7])
def test_mapping_keys_follow_the_same_rule(repo, key):
    with pytest.raises(luopan.InvalidPathError):
        repo.artifact("x").commit({key: b"data"})
    assert repo.artifact("x").numbers() == []


def test_the_cli_refuses_a_bad_name_with_exit_2_and_one_escaped_line(tmp_path):
    bad = tmp_path / "bad\nname.txt"
    bad.write_bytes(b"data")
    luopan.open(tmp_path / "repo").close()
    r = cli("artifact", "commit", "-r", tmp_path / "repo", "x", bad)
    assert r.exit_code == 2, r.output
    assert "'" + str(tmp_path) + "/bad\\nname.txt'" in r.output.replace("\n", "")
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_the_name_rule(tmp_path):
    good = ["a", "a/b.txt", "é/日本語.txt", "with space", "emoji\u200d", "-x", "a.b.c", "x" * 4096]
    bad = ["", "/abs", "a/", "a//b", ".", "..", "a/../b", "./a", "a\\b", "a\nb", "a\tb", "\x00", "\x7f", "\x9f",
           "\u2028", "\u2029", "\udcff", "\ud800", "x" * 4097, None, b"a"]
    assert [p for p in good if path_problem(p)] == []
    assert [p for p in bad if path_problem(p) is None] == []
    assert show_path("\udcff\udcfe") == repr(b"\xff\xfe")  # a name that is not UTF-8: its bytes
    assert show_path("a\nb") == "'a\\nb'"


# -- item 12, readers: a manifest an older luopan wrote with such a name ---------------------------------------------
@pytest.fixture
def old_bad_manifest(repo, tmp_path, monkeypatch):
    """The repository after an older luopan (no name rule) committed ``bad\\nname`` as artifact "old"; a good
    artifact and a pruned-away version give gc something to collect."""
    path = tmp_path / "bad\nname"
    path.write_bytes(os.urandom(200_000))
    with monkeypatch.context() as m:
        m.setattr(sources, "check_relpath", lambda _p: None)
        repo.artifact("old").commit(str(path))
    good = repo.artifact("good")
    good.commit({"a": os.urandom(100_000)})
    good.commit({"a": os.urandom(100_000)})
    good.prune(luopan.retention.KeepLast(1))
    return repo


def test_readers_refuse_an_old_bad_name_with_a_typed_error(old_bad_manifest, tmp_path):
    art = old_bad_manifest.artifact("old")
    for call in (art.get, art.listing, lambda: art.checkout(tmp_path / "out"), lambda: art.open("bad\nname")):
        with pytest.raises(luopan.ManifestNameError, match=r"'bad\\nname'"):
            call()
    with pytest.raises(luopan.IntegrityError, match="bad"):
        art.verify()
    with pytest.raises(luopan.IntegrityError):
        old_bad_manifest.verify()
    assert not (tmp_path / "out").exists()


def test_gc_is_not_blocked_by_one_old_bad_name_and_keeps_what_it_references(old_bad_manifest):
    repo = old_bad_manifest
    key = artifact_manifest_key("old", 1)
    doc = json.loads(repo.store.get(key))
    needed = {doc["packs"][row[1]] for e in doc["entries"] if e["type"] == "file" for row in e["chunks"]}
    with pytest.warns(UserWarning, match="gc keeps everything"):
        report = repo.gc(grace=0, repack_below=1.0)  # repack everything it may: the kept packs must stay as they are
    assert report.deleted_packs >= 1  # the pruned version's data went
    assert len(report.unloadable_manifests) == 1 and key in report.unloadable_manifests[0]
    assert needed <= {k.rsplit("/", 1)[-1][:-5] for k in repo.store.list("packs/")}
    assert json.loads(repo.store.get(key)) == doc  # never rewritten
    assert repo.artifact("good").listing()[0]["path"] == "a"
    repo.artifact("good").verify()
    repo.store.delete(key)  # what the message says to do once the files are committed again
    report = repo.gc(grace=0)
    assert report.unloadable_manifests == []
    assert not needed & {k.rsplit("/", 1)[-1][:-5] for k in repo.store.list("packs/")}


def test_gc_still_refuses_a_manifest_damaged_beyond_its_names(old_bad_manifest):
    repo = old_bad_manifest
    key = artifact_manifest_key("old", 1)
    doc = json.loads(repo.store.get(key))
    doc.pop("checksum")
    doc["entries"][0]["chunks"][0][1] = 99  # names a pack that is not listed: what it needs is unknown
    repo.store.put(key, luopan.format.canonical.seal(doc))
    with pytest.raises(luopan.GcError, match="before deleting anything"):
        repo.gc(grace=0)


def test_the_cli_gc_and_verify_on_an_old_bad_name(old_bad_manifest, tmp_path):
    where = tmp_path / "repo"
    r = cli("gc", "-r", where, "--grace", "0")
    assert r.exit_code == 0, r.output
    r = cli("verify", "-r", where)
    assert r.exit_code == 3 and "bad\\nname" in r.output, r.output
    r = cli("artifact", "verify", "-r", where, "old")
    assert r.exit_code == 3, r.output


# -- a run and an artifact sharing a name ----------------------------------------------------------------------------
@pytest.fixture
def clash(tmp_path):
    path = tmp_path / "repo"
    repo = luopan.open(path)
    repo.save("both", 1, {"w": np.ones(3)})
    repo.save("both", 2, {"w": np.zeros(3)})
    repo.artifact("both").commit({"x": b"1"})
    repo.artifact("both").commit({"x": b"2"})
    return path, repo


@pytest.mark.parametrize("args", [("ls", "both"), ("pin", "both", "1"), ("unpin", "both", "1"),
                                  ("prune", "both", "--keep-last", "1"), ("verify", "both")])
def test_a_name_shared_by_a_run_and_an_artifact_is_ambiguous(clash, args):
    path, repo = clash
    r = cli(*args, "-r", path)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "'both' names both a run (2 checkpoint(s)) and an artifact (2 version(s))" in text
    assert "--kind run or --kind artifact" in text
    assert repo.steps("both") == [1, 2] and repo.artifact("both").numbers() == [1, 2]
    assert repo.run("both").pins() == {} and repo.artifact("both").pins() == {}


def test_kind_says_which(clash):
    path, repo = clash
    assert cli("pin", "both", "1", "--kind", "artifact", "-r", path).exit_code == 0
    assert list(repo.artifact("both").pins()) == [1] and repo.run("both").pins() == {}
    assert cli("pin", "both", "2", "--kind", "run", "-r", path).exit_code == 0
    assert list(repo.run("both").pins()) == [2]
    r = cli("ls", "both", "--kind", "artifact", "-r", path, "--json")
    assert r.exit_code == 0 and [v["version"] for v in json.loads(r.stdout)["versions"]] == [1, 2]
    r = cli("ls", "both", "--kind", "run", "-r", path, "--json")
    assert r.exit_code == 0 and [c["step"] for c in json.loads(r.stdout)["checkpoints"]] == [1, 2]
    assert cli("verify", "both", "--kind", "run", "-r", path).exit_code == 0
    assert cli("verify", "both", "--kind", "artifact", "-r", path).exit_code == 0
    assert cli("unpin", "both", "1", "--kind", "artifact", "-r", path).exit_code == 0
    assert cli("prune", "both", "--keep-last", "1", "--kind", "artifact", "-r", path).exit_code == 0
    assert repo.artifact("both").numbers() == [2] and repo.steps("both") == [1, 2]
    assert cli("ls", "both", "--kind", "table", "-r", path).exit_code == 2


def test_an_unshared_name_needs_no_kind(clash):
    path, repo = clash
    repo.artifact("only-art").commit({"x": b"1"})
    r = cli("ls", "only-art", "-r", path, "--json")
    assert r.exit_code == 0 and "versions" in json.loads(r.stdout)
    r = cli("ls", "both", "-r", path, "--kind", "run", "--json")
    assert r.exit_code == 0

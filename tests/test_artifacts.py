"""Artifacts (docs/format.md §8.2): versioned files and directories in the same repository as checkpoints.

The behaviour tests run on every backend (memory, local disk, the S3-protocol server, a tiered repository); CDC
locality, refusals, gc after pruning, lineage and crash tests follow.
"""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
import time

import numpy as np
import pytest

import luopan
from luopan.artifact.ownfiles import RECORD
from luopan.artifact.writer import CDC_MAX
from luopan.format.names import artifact_manifest_key
from luopan.store import MemoryStore

from .conftest import PYTHON
from .s3server import fresh_url, s3_endpoint  # noqa: F401  (s3_endpoint is a fixture)

MiB = 1 << 20


def make_tree(root, seed=0):
    """A small directory: nested files, an empty file, an empty directory, a read-only file, an executable."""
    rng = np.random.default_rng(seed)
    os.makedirs(root / "sub" / "deeper", exist_ok=True)
    os.makedirs(root / "empty-dir", exist_ok=True)
    (root / "a.jsonl").write_bytes(b"".join(b'{"id": %d, "text": "row %d"}\n' % (i, i * seed) for i in range(3000)))
    (root / "sub" / "weights.bin").write_bytes(rng.bytes(700_000))
    (root / "sub" / "deeper" / "notes.txt").write_text("hello\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o755)
    os.chmod(root / "sub" / "deeper" / "notes.txt", 0o444)
    return root


def tree_of(root):
    """{relative path: (kind, mode, bytes)} of everything under root, but a checkout's record (luopan's own file)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if rel == RECORD:
                continue
            if stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), None)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(st.st_mode), f.read())
    return out


@pytest.fixture(params=["memory", "local", "s3", "tiered"])
def backend_repo(request, tmp_path):
    if request.param == "memory":
        repo = luopan.open(MemoryStore())
    elif request.param == "local":
        repo = luopan.open(tmp_path / "repo")
    elif request.param == "s3":
        request.getfixturevalue("s3_endpoint")
        repo = luopan.open(fresh_url())
    else:
        repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"))
    yield repo
    repo.close()


# -- every backend --------------------------------------------------------------------------------------------------

def test_commit_checkout_roundtrip_on_every_backend(backend_repo, tmp_path):
    src = make_tree(tmp_path / "src")
    art = backend_repo.artifact("datasets/clean")
    v = art.commit(src, metadata={"rows": 3000}, parents=None)
    assert (v.name, v.version, v.ref) == ("datasets/clean", 1, "datasets/clean@1")
    assert v.files == ["a.jsonl", "empty.txt", "run.sh", "sub/deeper/notes.txt", "sub/weights.bin"]
    assert v.dirs == ["empty-dir", "sub", "sub/deeper"]
    assert v.logical_bytes == sum(len(b) for k, _m, b in tree_of(src).values() if k == "file")
    assert v.stored_bytes > 0 and v.metadata == {"rows": 3000}
    out = art.checkout(tmp_path / "out")
    assert tree_of(out) == tree_of(src)  # bytes, modes, empty file and empty directory
    with art.open("a.jsonl") as f:
        assert f.readline() == b'{"id": 0, "text": "row 0"}\n'
        assert f.read() == (src / "a.jsonl").read_bytes()[len(b'{"id": 0, "text": "row 0"}\n'):]
    with art.open("empty.txt") as f:
        assert f.read() == b""
    # identical content: a new version that writes nothing
    v2 = art.commit(src)
    assert v2.version == 2 and v2.stored_bytes == 0 and v2.new_chunks == 0
    assert [x.version for x in art.versions()] == [1, 2]
    assert backend_repo.artifact_names() == ["datasets/clean"]
    if backend_repo.tier is not None:  # tiered: the remote gets every version, and it reads back there
        assert backend_repo.wait_replicated(timeout=60)
        remote = luopan.open(tmp_path / "remote", create=False)
        assert tree_of(remote.artifact("datasets/clean").checkout(tmp_path / "from-remote", 1)) == tree_of(src)
        remote.close()


def test_mapping_and_single_file_commits(backend_repo, tmp_path):
    art = backend_repo.artifact("evals/run-a")
    v = art.commit({"b/c.json": b'{"x": 1}', "a.txt": b"A" * 100, "z": b""})
    assert v.root == "files" and v.files == ["a.txt", "b/c.json", "z"] and v.dirs == ["b"]
    with art.open("b/c.json", version=1) as f:
        assert f.read() == b'{"x": 1}'
    single = tmp_path / "one.bin"
    single.write_bytes(os.urandom(300_000))
    v2 = backend_repo.artifact("models/one").commit(single)
    assert v2.root == "file" and v2.files == ["one.bin"]
    out = backend_repo.artifact("models/one").checkout(tmp_path / "one-out")
    assert (tmp_path / "one-out" / "one.bin").read_bytes() == single.read_bytes() and out.endswith("one-out")


def test_verify_du_pin_prune_gc_on_every_backend(backend_repo):
    art = backend_repo.artifact("d")
    for i in range(3):
        art.commit({"f": bytes([i]) * 200_000})
    art.pin(1, tag="golden")
    assert art.verify() == 3 * 200_000
    backend_repo.verify()  # the whole repository, artifacts included
    du = backend_repo.du()
    assert du["artifacts"] == 3 and du["logical_bytes"] == 600_000
    plan = art.prune(luopan.retention.KeepLast(1))
    assert plan.remove == [2]  # 1 is pinned, 3 the newest
    assert [v.version for v in art.versions()] == [1, 3]
    backend_repo.gc(grace=0)
    with art.open("f", version=1) as f:
        assert f.read() == b"\0" * 200_000
    with art.open("f") as f:
        assert f.read() == b"\2" * 200_000


# -- versions, names, refusals --------------------------------------------------------------------------------------

def test_versions_are_never_overwritten_and_names_are_checked(repo, tmp_path):
    art = repo.artifact("a/b")
    art.commit({"x": b"1"})
    key = artifact_manifest_key("a/b", 1)
    first = repo.store.get(key)
    art.commit({"x": b"2"})
    assert repo.store.get(key) == first
    for bad in ("", "/a", "a/", "a//b", "../a", "a/../b", "a b", "a/.tmp-x", "_v", "a/_v/b", "ä", "x" * 300):
        with pytest.raises(luopan.InvalidNameError):
            repo.artifact(bad)
    with pytest.raises(luopan.ArtifactNotFoundError, match="no version 7"):
        art.get(7)
    with pytest.raises(luopan.ArtifactNotFoundError, match="has no committed version"):
        repo.artifact("nothing").checkout(tmp_path / "o")
    with pytest.raises(luopan.ArtifactNotFoundError, match="has no file 'nope'"):
        art.open("nope")
    with pytest.raises(luopan.InvalidNameError):
        art.get(0)


@pytest.mark.parametrize("make", ["symlink", "dangling", "fifo", "socket"])
def test_special_files_are_refused_naming_them(repo, tmp_path, make):
    src = make_tree(tmp_path / "src")
    target = src / "sub" / "odd"
    if make == "symlink":
        os.symlink(src / "a.jsonl", target)
    elif make == "dangling":
        os.symlink(tmp_path / "gone", target)
    elif make == "fifo":
        os.mkfifo(target)
    else:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.bind(str(target))
        s.close()
    before = sorted(repo.store.list(""))
    with pytest.raises(luopan.UnsupportedFileError, match=str(target)):
        repo.artifact("x").commit(src)
    assert sorted(repo.store.list("")) == before  # nothing written
    assert repo.artifact("x").versions() == []


def test_paths_escaping_the_directory_are_refused(repo):
    for bad in ("../x", "/etc/passwd", "a/../../b", "a//b", "./a", "a\\b", "a\nb", ""):
        with pytest.raises(luopan.UnsupportedFileError):
            repo.artifact("x").commit({bad: b"data"})
    with pytest.raises(luopan.UnsupportedFileError, match="both as a file and as a directory"):
        repo.artifact("x").commit({"a": b"1", "a/b": b"2"})
    with pytest.raises(luopan.ArgumentTypeError):
        repo.artifact("x").commit({"a": "text, not bytes"})
    assert repo.artifact("x").versions() == []


def test_checkout_never_clobbers_and_never_leaves_a_partial_directory(repo, tmp_path):
    art = repo.artifact("x")
    art.commit({"f": os.urandom(500_000), "g": b"small"})
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "g").write_bytes(b"mine")  # an existing folder is updated in place, local files kept
    with pytest.raises(luopan.CheckoutConflictError, match="force"):
        art.checkout(tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == ["g"]
    assert art.checkout(tmp_path / "no" / "parent") == str(tmp_path / "no" / "parent")  # parents are made
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(luopan.OutputPathError, match="cannot create"):
        art.checkout(tmp_path / "file" / "below")
    # a damaged chunk: IntegrityError, and no directory (nor temporary) left behind
    pack = next(k for k in repo.store.list("packs/"))
    path = os.path.join(repo.store.root, pack)
    with open(path, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(luopan.IntegrityError):
        art.checkout(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["file", "no", "repo", "taken"]
    with pytest.raises(luopan.IntegrityError):
        with art.open("f") as f:
            f.read()


# -- content-defined chunking -----------------------------------------------------------------------------------------

def jsonl(n_bytes, seed):
    rng = np.random.default_rng(seed)
    lines = []
    total = 0
    while total < n_bytes:
        line = b'{"id": %d, "v": "%s"}\n' % (total, rng.bytes(24).hex().encode())
        lines.append(line)
        total += len(line)
    return b"".join(lines)


@pytest.mark.parametrize("edit", ["insert", "delete", "append", "prepend"])
def test_cdc_keeps_edits_local(repo, edit):
    base = jsonl(24 * MiB, 1)
    art = repo.artifact("big")
    v1 = art.commit({"data.jsonl": base})
    middle = base.index(b"\n", len(base) // 2) + 1
    new = jsonl(MiB, 2)
    changed = {"insert": base[:middle] + new + base[middle:],
               "delete": base[:middle] + base[middle + MiB:],
               "append": base + new,
               "prepend": new + base}[edit]
    v2 = art.commit({"data.jsonl": changed})
    # what changed, plus at most the chunks on either side of each edit
    limit = (MiB if edit != "delete" else 0) + 2 * CDC_MAX
    assert v2.new_bytes <= limit, (edit, v2.new_bytes, limit)
    assert v1.new_bytes >= len(base)
    with art.open("data.jsonl") as f:
        assert f.read() == changed


def test_streamed_cuts_equal_whole_buffer_cuts():
    from pyfastcdc import FastCDC

    from luopan.artifact.writer import CDC_AVG, CDC_MIN, READ_BLOCK, cdc_chunks

    data = os.urandom(2 * READ_BLOCK + 12345)
    streamed = [bytes(c) for c in cdc_chunks(io.BytesIO(data), len(data))]
    whole = [bytes(c.data) for c in FastCDC(avg_size=CDC_AVG, min_size=CDC_MIN, max_size=CDC_MAX).cut_buf(data)]
    assert streamed == whole
    grew = [bytes(c) for c in cdc_chunks(io.BytesIO(data), 1000)]  # a file larger than its stat said
    assert grew == whole


# -- gc across kinds ----------------------------------------------------------------------------------------------------

def live_hashes(repo):
    from luopan.format.index import parse_index

    out = set()
    for key in repo.store.list("index/"):
        out |= set(parse_index(repo.store.get(key), key))
    return out


def test_gc_after_pruning_artifacts_frees_only_their_unshared_chunks(repo):
    shared = os.urandom(50_000)  # one chunk, also saved by a checkpoint (same bytes, same BLAKE3)
    only_v1 = os.urandom(60_000)
    art = repo.artifact("d")
    v1 = art.commit({"shared.bin": shared, "only.bin": only_v1})
    state = {"w": np.frombuffer(shared, dtype=np.uint8).copy()}
    info = repo.save("run-a", 1, state)
    assert info.new_chunks == 0  # deduplicated against the artifact's chunk
    art.commit({"other.bin": os.urandom(70_000)})
    import blake3

    h_shared, h_only = blake3.blake3(shared).hexdigest(), blake3.blake3(only_v1).hexdigest()
    assert {h_shared, h_only} <= live_hashes(repo)
    art.prune(luopan.retention.KeepLast(1))
    assert [v.version for v in art.versions()] == [2]
    report = repo.gc(grace=0)
    assert report.deleted_packs >= 1
    live = live_hashes(repo)
    assert h_shared in live and h_only not in live
    np.testing.assert_array_equal(repo.load("run-a", 1)["w"], state["w"])
    repo.verify()
    assert v1.version == 1


# -- lineage --------------------------------------------------------------------------------------------------------------

def test_lineage_up_the_graph_and_checkpoints_that_used_it(repo):
    repo.artifact("datasets/raw").commit({"r": b"raw"})
    repo.artifact("datasets/clean").commit({"c": b"clean"}, parents=["datasets/raw@1"])
    repo.artifact("datasets/train").commit({"t": b"t1"})
    repo.artifact("datasets/train").commit({"t": b"t2"}, parents=["datasets/clean@1", "datasets/raw@1"])
    repo.save("run-a", step=100, state={"x": np.arange(3)}, inputs=["datasets/train@2"])
    lin = repo.lineage("datasets/train@2")
    assert lin.parents == ["datasets/clean@1", "datasets/raw@1"]
    assert lin.ancestors == ["datasets/clean@1", "datasets/raw@1"]
    assert ("datasets/clean@1", "datasets/raw@1") in lin.edges
    assert lin.checkpoints == ["run-a@100"]
    assert repo.lineage("datasets/raw@1").children == ["datasets/clean@1", "datasets/train@2"]
    assert repo.lineage("run-a@100").parents == ["datasets/train@2"]
    assert repo.manifest("run-a", 100).doc["inputs"] == ["datasets/train@2"]
    with pytest.raises(luopan.ManifestNotFoundError, match="does not exist"):
        repo.save("run-a", 101, {"x": np.arange(3)}, inputs=["datasets/train@9"])
    with pytest.raises(luopan.InvalidNameError, match="NAME@NUMBER"):
        repo.save("run-a", 101, {"x": np.arange(3)}, inputs=["datasets/train"])
    with pytest.raises(luopan.ManifestNotFoundError):
        repo.artifact("x").commit({"a": b"1"}, parents=["datasets/none@1"])
    assert repo.steps("run-a") == [100] and repo.artifact("x").versions() == []


# -- crashes ----------------------------------------------------------------------------------------------------------------

CHILD = r"""
import os, sys, luopan
repo = luopan.open(sys.argv[1])
op = sys.argv[2]
if op == "commit":
    print("ready", flush=True)
    repo.artifact("big").commit(sys.argv[3])
else:
    print("ready", flush=True)
    repo.artifact("big").checkout(sys.argv[3])
print("done", flush=True)
"""


def big_tree(root, mib):
    root.mkdir()
    for i in range(8):
        (root / f"part-{i}.bin").write_bytes(os.urandom(mib * MiB // 8))
    return root


@pytest.mark.parametrize("point", ["artifact.chunk.written", "pack.written", "pack.renamed", "index.renamed",
                                   "manifest.written", "manifest.fsynced"])
def test_crash_points_during_commit_leave_the_old_version(tmp_path, child_env, point):
    repo_path = tmp_path / "repo"
    with luopan.open(repo_path) as repo:
        repo.artifact("big").commit({"old": b"old version"})
    src = big_tree(tmp_path / "src", 8)
    env = {**child_env, "LUOPAN_CRASH_AT": point}
    proc = subprocess.run([PYTHON, "-c", CHILD, str(repo_path), "commit", str(src)], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == 97, proc.stderr.decode()[-2000:]
    with luopan.open(repo_path) as repo:
        art = repo.artifact("big")
        assert [v.version for v in art.versions()] == [1]
        with art.open("old") as f:
            assert f.read() == b"old version"
        repo.verify()
        v2 = art.commit(src)  # the next commit works, and the garbage goes with gc
        assert v2.version == 2
        repo.gc(grace=0)
        repo.verify()


def test_crash_point_during_checkout_leaves_no_partial_directory(tmp_path, child_env):
    repo_path = tmp_path / "repo"
    src = big_tree(tmp_path / "src", 4)
    with luopan.open(repo_path) as repo:
        repo.artifact("big").commit(src)
    (tmp_path / "co").mkdir()
    dest = tmp_path / "co" / "out"
    env = {**child_env, "LUOPAN_CRASH_AT": "artifact.checkout.built"}
    proc = subprocess.run([PYTHON, "-c", CHILD, str(repo_path), "checkout", str(dest)], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 97, proc.stderr.decode()[-2000:]
    assert not dest.exists()
    leftovers = os.listdir(tmp_path / "co")
    assert len(leftovers) == 1 and leftovers[0].startswith(".out.tmp-")  # hidden, never at the destination
    with luopan.open(repo_path) as repo:
        repo.artifact("big").checkout(dest)  # removes the dead process's temporary directory
    assert tree_of(dest) == tree_of(src)
    assert os.listdir(tmp_path / "co") == ["out"]


@pytest.mark.parametrize("op", ["commit", "checkout"])
def test_sigkill_at_random_moments(tmp_path, child_env, op):
    """kill -9 a committing / checking-out process at random moments: the old version intact, nothing partial."""
    repo_path = tmp_path / "repo"
    src = big_tree(tmp_path / "src", 32)
    with luopan.open(repo_path) as repo:
        repo.artifact("big").commit({"old": b"old"})
        if op == "checkout":
            repo.artifact("big").commit(src)
    rng = np.random.default_rng(5)
    for attempt in range(6):
        dest = tmp_path / f"out-{attempt}"
        proc = subprocess.Popen([PYTHON, "-c", CHILD, str(repo_path), op, str(src if op == "commit" else dest)],
                                env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline() == b"ready\n"
        time.sleep(float(rng.uniform(0.0, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with luopan.open(repo_path) as repo:
            art = repo.artifact("big")
            numbers = [v.version for v in art.versions()]
            with art.open("old", version=1) as f:
                assert f.read() == b"old"
            if op == "commit":
                assert numbers[0] == 1 and numbers == list(range(1, len(numbers) + 1))
                for n in numbers[1:]:  # any version that became visible is complete
                    assert art.get(n).logical_bytes == 32 * MiB
            else:
                assert not dest.exists() or tree_of(dest) == tree_of(src)
            repo.verify()


# -- the README's examples ----------------------------------------------------------------------------------------

def readme_blocks(lang):
    import re

    from .conftest import ROOT

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return [b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if "artifact commit" in b or "repo.artifact(" in b]


def test_readme_artifact_examples_run_as_written(tmp_path, child_env):
    (python_block,) = readme_blocks("python")
    (bash_block,) = readme_blocks("bash")
    env = {**child_env, "PATH": os.path.dirname(PYTHON) + os.pathsep + child_env.get("PATH", "")}
    proc = subprocess.run([PYTHON, "-c", python_block], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"['run-a@100']" in proc.stdout
    assert b"['part-0001.jsonl']" in proc.stdout  # status saw the edit; the forced checkout took it back
    assert (tmp_path / "out-clean" / "part-0001.jsonl").read_text() == '{"id": 1, "text": "hello"}\n'
    luopan_cli = os.path.join(os.path.dirname(PYTHON), "luopan")
    script = bash_block.replace("luopan ", f"{luopan_cli} ")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-3000:]
    assert (tmp_path / "out-v2" / "part-0001.jsonl").exists()
    assert not (tmp_path / "out-v2" / "part-0002.jsonl").exists()  # updated in place to datasets/clean@1
    assert "part-0002.jsonl" in proc.stdout.decode()  # the diff's added file
    with luopan.open(tmp_path / "ckpts") as repo:
        assert [v.version for v in repo.artifact("datasets/clean").versions()] == [2]
        assert repo.lineage("datasets/clean@2").parents == ["datasets/raw@1"]
        assert repo.repository.lineage("run-a@100").parents == ["datasets/clean@1", "datasets/clean@2"]  # linked


# -- review findings: tiers, limits, hostile input ----------------------------------------------------------------

def test_tiered_artifacts_replicate_evict_and_read_back(tmp_path):
    """Replicated, evicted locally (local_retention), collected by gc, then read back from the remote."""
    from luopan.format import FORMAT_VERSION
    from luopan.format.canonical import unseal

    local, remote = tmp_path / "local", tmp_path / "remote"
    # compression="none": an "auto" config is itself version 5 (§3), and this checks the raise to the artifacts' 3
    with luopan.open(local, replicate_to=str(remote), local_retention=luopan.retention.KeepLast(1),
                     compression="none") as repo:
        art = repo.artifact("ds/x")
        payloads = [os.urandom(300_000) for _ in range(3)]
        for p in payloads:
            art.commit({"f.bin": p})
        assert repo.wait_replicated(timeout=60)
        assert repo.tier.status(repo.kinds[0], "ds/x") == {1: "remote", 2: "remote", 3: "replicated"}
        repo.gc(grace=0)  # frees what eviction left locally
        with art.open("f.bin", version=1) as f:  # read (and verified) from the remote
            assert f.read() == payloads[0]
        assert tree_of(art.checkout(tmp_path / "v2", 2)) == {"f.bin": ("file", 0o644, payloads[1])}
        assert art.commit({"f.bin": b"new"}).version == 4  # numbers of evicted versions are never reused
        assert repo.wait_replicated(timeout=60)
    # the remote is a repository of its own, at the format its artifacts need (older readers refuse it)
    assert unseal((remote / "luopan.json").read_bytes())["format_version"] == 3 <= FORMAT_VERSION
    with luopan.open(remote, create=False) as there:
        assert [v.version for v in there.artifact("ds/x").versions()] == [1, 2, 3, 4]
        there.verify()


def test_version_numbers_of_cold_versions_are_never_reused(tmp_path):
    import shutil
    from datetime import datetime, timedelta, timezone

    local, remote, cold = tmp_path / "local", tmp_path / "remote", tmp_path / "cold"
    with luopan.open(local, replicate_to=str(remote),
                     cold=luopan.ColdPolicy(str(cold), older_than="1d")) as repo:
        art = repo.artifact("ds/x")
        art.commit({"f": b"first"})
        assert repo.wait_replicated(timeout=60)
        assert repo.apply_cold_policy(datetime.now(timezone.utc) + timedelta(days=2)) == [("ds/x", 1)]
        shutil.rmtree(cold)  # the cold store out of reach: listing it finds nothing
        v = art.commit({"f": b"second"})
        assert v.version == 2


def test_many_small_files_and_few_file_descriptors(tmp_path, child_env):
    src = tmp_path / "src"
    for d in range(30):
        os.makedirs(src / f"d{d}")
        for f in range(100):
            (src / f"d{d}" / f"{f}.txt").write_bytes(b"%d/%d\n" % (d, f) * (f + 1))
    script = f"""
import resource, luopan
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
repo = luopan.open({str(tmp_path / 'repo')!r})
v = repo.artifact("many").commit({str(src)!r})
assert len(v.files) == 3000, len(v.files)
repo.artifact("many").checkout({str(tmp_path / 'out')!r})
print("ok")
"""
    proc = subprocess.run([PYTHON, "-c", script], env=child_env, capture_output=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == b"ok\n", proc.stderr.decode()[-3000:]
    assert tree_of(tmp_path / "out") == tree_of(src)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can commit a file it owns with setuid in a test")
def test_checkout_never_restores_setuid_or_setgid(repo, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "tool", 0o6755)
    assert repo.artifact("x").commit(src).version == 1
    assert repo.artifact("x").listing()[0]["mode"] == 0o6755  # recorded as it was
    out = repo.artifact("x").checkout(tmp_path / "out")
    assert stat.S_IMODE(os.stat(os.path.join(out, "tool")).st_mode) == 0o755


def test_bad_arguments_are_luopan_errors(repo, tmp_path):
    art = repo.artifact("x")
    art.commit({"a": b"1"})
    for bad in (None, 5, ""):
        with pytest.raises(luopan.ArgumentTypeError):
            art.checkout(bad)
    strided = memoryview(np.zeros((4, 4))[:, ::2])
    with pytest.raises(luopan.ArgumentTypeError, match="contiguous"):
        art.commit({"s": strided})
    with pytest.raises(luopan.UsageError, match="parents"):
        art.commit({"a": b"2"}, parents="x@1")
    with pytest.raises(luopan.UsageError, match="metadata"):
        art.commit({"a": b"2"}, metadata={"x": float("nan")})
    with pytest.raises(luopan.ArtifactNotFoundError, match="does not exist"):
        art.commit(tmp_path / "missing")
    with pytest.raises(luopan.InvalidNameError, match="8 parts"):
        repo.artifact("/".join("abcdefghi"))
    assert repo.artifact("/".join("abcdefgh")).commit({"a": b"1"}).version == 1
    assert [v.version for v in art.versions()] == [1]


def test_whole_repository_verify_checks_artifact_pins(repo):
    art = repo.artifact("ds/x")
    art.commit({"a": b"1"})
    art.pin(1, tag="keep")
    repo.verify()
    from luopan.format.names import artifact_pin_key

    path = os.path.join(repo.store.root, artifact_pin_key("ds/x", 1))
    with open(path, "r+b") as f:
        f.seek(5)
        f.write(b"#")
    with pytest.raises(luopan.IntegrityError) as exc:
        repo.verify()
    assert any("refs/pins/_artifacts/ds/x/00000001.json" in str(p) for p in exc.value.problems)

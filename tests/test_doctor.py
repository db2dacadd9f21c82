"""``luopan doctor`` (luopan.doctor): each problem it checks for, in a repository made to have it, found with the
right message, status and exit code (0 all ok, 1 a warning, 3 damaged data, 4 no repository); a clean repository
passes; and doctor never changes the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
import luopan.cli.doctor
import luopan.doctor
from luopan.cli.app import app
from luopan.doctor import filesystem
from luopan.doctor.filesystem import Mount, classify, mount_for, parse_mountinfo
from luopan.format.canonical import seal, unseal
from luopan.format.manifest import Row
from luopan.format.names import lock_key, pack_key
from luopan.repository.locks import Lock
from luopan.store import LocalStore

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
EXT4 = Mount("/", "ext4", "/dev/sda1")


@pytest.fixture(autouse=True)
def disk_filesystem(monkeypatch):
    """Every repository looks like it is on ext4 (tmp_path may be on tmpfs or overlay in CI); the filesystem tests
    set their own."""
    monkeypatch.setattr(filesystem, "mount_of", lambda path: EXT4)


def doctor(repo, *args, code=0):
    res = CliRunner().invoke(app, ["doctor", "-r", str(repo), *map(str, args)])
    assert res.exit_code == code, (res.exit_code, res.output)
    return res.output


def doctor_json(repo, *args, code=0):
    res = CliRunner().invoke(app, ["doctor", "-r", str(repo), "--json", *map(str, args)])
    assert res.exit_code == code, (res.exit_code, res.output)
    return json.loads(res.output)


def by_check(findings, check):
    return [f for f in findings if f["check"] == check]


def line(output, check, status="warn"):
    """The one output line of ``check`` with ``status``."""
    found = [ln for ln in output.splitlines() if ln.startswith(f"{status:<4} {check}: ")]
    assert len(found) == 1, output
    return found[0]


def make_repo(path, **options):
    with luopan.open(path, **options) as r:
        r.save("a", 1, {"w": np.arange(20000, dtype=np.float32)})
        r.save("a", 2, {"w": np.arange(20000, dtype=np.float32) + 1})
        r.save("b", 7, {"w": np.ones(100)})
    return path


def tree(root):
    """Every file under ``root`` with its size and mtime: doctor must leave it as it was."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def put_lock(root, kind="shared", token="0" * 16, **fields):
    """A lock record as luopan writes it, with ``fields`` changed (pid, created, refreshed, host)."""
    store = LocalStore(root)
    doc = unseal(Lock(store, kind, "save")._record())
    doc.pop("checksum", None)
    doc.update(fields)
    key = lock_key(kind, token)
    store.put(key, seal(doc))
    return os.path.join(root, *key.split("/"))


# -- a clean repository ---------------------------------------------------------------------------------------------
def test_a_clean_repository_passes(tmp_path):
    repo = make_repo(tmp_path / "repo")
    out = doctor(repo)
    for check in ("space", "locks", "verify", "leftovers", "strays", "filesystem", "format", "clock"):
        assert f"ok   {check}: " in out
    assert "warn" not in out and "FAIL" not in out
    assert "the newest of each of 2 runs verifies: every chunk" in out
    assert "is on ext4 (mounted at / from /dev/sda1): rename and fsync are durable" in out
    assert f"repository format version {luopan.format.FORMAT_VERSION} (this luopan's)" in out
    assert out.rstrip().endswith("all 8 checks passed")
    findings = doctor_json(repo)
    assert all(set(f) == {"check", "status", "message", "fix"} for f in findings)
    assert {f["status"] for f in findings} == {"ok"} and all(f["fix"] is None for f in findings)
    assert [f["check"] for f in findings] == ["space", "locks", "verify", "leftovers", "strays", "filesystem",
                                              "format", "clock"]


def test_the_library_returns_findings(tmp_path):
    repo = make_repo(tmp_path / "repo")
    findings = luopan.doctor.run_checks(str(repo))
    assert all(isinstance(f, luopan.doctor.Finding) for f in findings)
    assert luopan.doctor.exit_code(findings) == 0
    with luopan.open(repo) as r:  # an open repository works too, and stays open
        assert luopan.doctor.exit_code(luopan.doctor.run_checks(r)) == 0
        assert r.steps("a") == [1, 2]


def test_no_repository_exits_4(tmp_path):
    res = CliRunner().invoke(app, ["doctor", "-r", str(tmp_path / "nothing")])
    assert res.exit_code == 4 and "no luopan repository" in res.output
    with pytest.raises(luopan.errors.RepoNotFoundError):
        luopan.doctor.run_checks(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()


# -- free space -----------------------------------------------------------------------------------------------------
def test_low_free_space(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setattr(luopan.doctor, "default_free_bytes", lambda store: 1000)
    out = doctor(repo, code=1)
    msg = line(out, "space")
    assert "only 1000 B free on" in msg and "1.5× run 'a' step 2's 78.1 KiB" in msg
    assert "will be refused (InsufficientSpaceError)" in msg
    assert "free space elsewhere on that disk" in msg
    (f,) = by_check(doctor_json(repo, code=1), "space")
    assert f["status"] == "warn" and "1000 B" in f["message"] and f["fix"]
    # the probe can also be passed to the library; plenty of space passes
    ok = luopan.doctor.run_checks(repo, free_bytes=lambda store: 1 << 40)
    assert [f.status for f in ok if f.check == "space"] == ["ok"]


def test_low_free_space_names_what_gc_and_prune_would_free(tmp_path):
    repo = make_repo(tmp_path / "repo")
    with luopan.open(repo) as r:
        r.save("a", 3, {"w": np.arange(20000, dtype=np.float32) + 2})
    (f,) = [f for f in luopan.doctor.run_checks(repo, free_bytes=lambda s: 10) if f.check == "space"]
    assert f.status == "warn" and "pruning every checkpoint except the newest" in f.fix and "`luopan prune RUN --keep-last N`" in f.fix


# -- locks and clocks -----------------------------------------------------------------------------------------------
def test_stale_locks_of_dead_processes(tmp_path):
    repo = make_repo(tmp_path / "repo")
    pid = dead_pid()
    put_lock(str(repo), pid=pid, token="0" * 16)
    put_lock(str(repo), pid=pid, token="1" * 16)
    out = doctor(repo, code=1)
    msg = line(out, "locks")
    assert msg.startswith("warn locks: 2 stale locks (holders dead: shared lock for save by pid ")
    assert msg.endswith(f"run `luopan unlock -r {repo}` (a save on this host also removes them)")
    assert len([n for n in os.listdir(repo / "locks") if n.endswith(".json")]) == 2  # doctor removed nothing


def test_a_lock_not_refreshed_for_long(tmp_path):
    repo = make_repo(tmp_path / "repo")
    old = time.time() - 7200
    path = put_lock(str(repo), kind="exclusive", host="another-host", created=old, refreshed=old)
    os.utime(path, (old, old))  # written then: the clocks agree
    out = doctor(repo, code=1)
    assert "1 lock not refreshed for over 30m (a hung process, or one on another host" in line(out, "locks")
    assert "another-host" in line(out, "locks")
    assert "ok   clock:" in out


def test_a_damaged_lock_file(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "locks" / "exclusive-2222222222222222.json").write_bytes(b"{not json")
    out = doctor(repo, code=1)
    msg = line(out, "locks")
    assert "1 damaged lock record (locks/exclusive-2222222222222222.json): each blocks every save" in msg
    assert f"run `luopan unlock -r {repo}` (it removes damaged records)" in msg


def test_a_live_lock_is_fine(tmp_path):
    repo = make_repo(tmp_path / "repo")
    put_lock(str(repo), pid=os.getpid())
    out = doctor(repo)
    assert f"no stale or damaged locks; 1 lock held by running processes (shared lock for save by pid {os.getpid()}" \
        in line(out, "locks", "ok")


def test_clock_skew_a_lock_dated_in_the_future(tmp_path):
    repo = make_repo(tmp_path / "repo")
    ahead = time.time() + 3 * 3600
    put_lock(str(repo), pid=os.getpid(), created=ahead, refreshed=ahead)
    out = doctor(repo, code=1)
    msg = line(out, "clock")
    assert "clocks disagree: shared lock for save by pid" in msg and re.search(r"is dated (2h59m\d+s|3h) in", msg)
    assert f"in the future (host {socket.gethostname()})" in msg
    assert "synchronize the clocks of every host" in msg
    assert "ok   locks:" in out  # its holder runs: not stale
    (f,) = by_check(doctor_json(repo, code=1), "clock")
    assert f["status"] == "warn" and "NTP" in f["fix"]


def test_clock_skew_a_lock_stored_at_another_time_than_it_says(tmp_path):
    repo = make_repo(tmp_path / "repo")
    path = put_lock(str(repo), pid=os.getpid())
    later = time.time() + 600  # the storage's clock is 10 minutes ahead of the writer's
    os.utime(path, (later, later))
    assert re.search(r"was stored (9m\d+s|10m) after the time it records", line(doctor(repo, code=1), "clock"))


def test_clock_skew_a_checkpoint_from_the_future(tmp_path):
    repo = make_repo(tmp_path / "repo")
    findings = luopan.doctor.run_checks(repo, now=lambda: time.time() - 7200)  # this host's clock 2h behind
    (f,) = [f for f in findings if f.check == "clock"]
    assert f.status == "warn" and re.search(r"run 'a' step 2 was created (1h59m\d+s|2h) in the future", f.message)


# -- the newest checkpoint ------------------------------------------------------------------------------------------
def test_a_corrupted_byte_in_the_newest_checkpoint_exits_3(tmp_path):
    repo = make_repo(tmp_path / "repo", compression="none")
    with luopan.open(repo) as r:
        doc = r.manifest("a").doc
    row = Row._make(doc["entries"][0]["chunks"][0])
    pack = repo / pack_key(doc["packs"][row.pack])
    data = bytearray(pack.read_bytes())
    data[row.offset + 10] ^= 0xFF
    pack.write_bytes(bytes(data))
    out = doctor(repo, code=3)
    msg = line(out, "verify", "FAIL")
    assert "run 'a' step 2 (the newest) is damaged: hash mismatch: run 'a' step 2 entry 'w' chunk 0" in msg
    assert f"`luopan verify a 2 -r {repo}` names every damaged chunk" in msg
    assert "ok   verify" not in out  # no "verifies" line beside a damaged one
    (f,) = by_check(doctor_json(repo, code=3), "verify")
    assert f["status"] == "fail"


def test_a_missing_pack_of_the_newest_checkpoint(tmp_path):
    repo = make_repo(tmp_path / "repo")
    with luopan.open(repo) as r:
        doc = r.manifest("b").doc
    os.remove(repo / pack_key(doc["packs"][0]))
    msg = line(doctor(repo, code=3), "verify", "FAIL")
    assert "run 'b' step 7 (the newest) is damaged: missing pack" in msg


def test_a_damaged_newest_manifest(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "runs" / "b" / "ckpt" / "00000007.json").write_bytes(b"{}")
    assert "run 'b' step 7 (the newest) is damaged" in line(doctor(repo, code=3), "verify", "FAIL")


def test_big_checkpoints_are_sampled_unless_full(tmp_path):
    repo = tmp_path / "repo"
    with luopan.open(repo, chunk_size=4096, pack_size=65536, compression="none") as r:
        r.save("a", 1, {"w": np.random.default_rng(0).standard_normal(50 * 1024)})  # 400 KiB: 100 chunks
    assert "16 of 100 chunks (sampled; --full reads all)" in line(doctor(repo), "verify", "ok")
    assert "the newest of 1 run verifies: every chunk, 400.0 KiB read" in line(doctor(repo, "--full"), "verify", "ok")


# -- replication ----------------------------------------------------------------------------------------------------
def test_unreplicated_checkpoints_of_a_tiered_repository(tmp_path):
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    with luopan.open(repo, replicate_to=str(remote), replicate=False) as r:
        r.save("a", 1, {"w": np.arange(10.0)})
        r.save("a", 2, {"w": np.arange(10.0) + 1})
    before, remote_before = tree(repo), tree(remote)
    msg = line(doctor(repo, code=1), "replication")
    assert f"2 checkpoints not yet replicated to {remote} (run 'a' steps 1, 2): only this disk holds them" in msg
    assert f"run `luopan replicate -r {repo}`" in msg
    assert tree(repo) == before and tree(remote) == remote_before  # neither tier touched
    with luopan.open(repo) as r:
        assert r.wait_replicated(60)
    out = doctor(repo)
    assert f"2 local manifests, all confirmed on {remote}" in line(out, "replication", "ok")


def test_no_replication_check_without_tiers(tmp_path):
    assert not by_check(doctor_json(make_repo(tmp_path / "repo")), "replication")


# -- leftovers ------------------------------------------------------------------------------------------------------
def test_temp_files_of_interrupted_writes(tmp_path):
    repo = make_repo(tmp_path / "repo")
    host = socket.gethostname().replace("-", "_")
    dead = repo / "packs" / f"ab.pack.tmp-{host}-{dead_pid()}-0a1b2c3d"
    dead.write_bytes(b"x" * 2048)
    old = repo / "index" / "cd.json.tmp-otherhost-17-0a1b2c3d"
    old.write_bytes(b"y" * 10)
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    busy = repo / "runs" / "a" / f"record.json.tmp-{host}-{os.getpid()}-0a1b2c3d"  # a write in progress
    busy.write_bytes(b"z")
    young = repo / "packs" / "ef.pack.tmp-otherhost-18-0a1b2c3d"  # another host's, written just now
    young.write_bytes(b"w")
    before = tree(repo)
    msg = line(doctor(repo, code=1), "leftovers")
    assert msg.startswith("warn leftovers: 2 temp files of interrupted writes (2.0 KiB: ")
    assert f"packs/{dead.name}" in msg and f"index/{old.name}" in msg
    assert f"2 temp files of writes that may be in progress (packs/{young.name}; runs/a/{busy.name})" in msg
    assert f"run any luopan command on it, e.g. `luopan ls -r {repo}`" in msg
    assert tree(repo) == before  # doctor only reads: the leftovers are still there
    busy.unlink()
    young.unlink()
    with luopan.open(repo):  # opening removes those of dead writers
        pass
    assert "no temp files of interrupted writes" in line(doctor(repo), "leftovers", "ok")


def test_entries_that_are_not_luopans(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "runs" / "a" / "notes.txt").write_text("mine")
    os.symlink(tmp_path / "unmounted", repo / "runs" / "gone")
    out = doctor(repo, code=1)
    unreadable, foreign = [ln for ln in out.splitlines() if ln.startswith("warn strays: ")]
    assert "1 entry cannot be read (runs/gone: a dangling symbolic link" in unreadable
    assert "1 entry in the repository is not luopan's" in foreign and "runs/a/notes.txt" in foreign


# -- filesystems ----------------------------------------------------------------------------------------------------
MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
25 27 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
30 25 0:27 / /dev/shm rw,relatime - tmpfs shm rw,size=65536k
40 27 0:50 / /mnt/nfs rw,relatime shared:5 - nfs4 server:/export rw,vers=4.2
41 27 0:51 / /data/my\\040bucket rw,nosuid - fuse.s3fs s3fs rw,user_id=0
42 27 0:52 / /mnt/share rw - cifs //nas/share rw,cache=strict
43 27 0:53 / /workspace rw - overlay overlay rw,lowerdir=/l,upperdir=/u
44 27 0:54 / /mnt/host rw - 9p C:\\134 rw,trans=virtio
45 27 8:1 / /mnt/nfs/local rw - xfs /dev/sdb1 rw
garbage line
"""


def test_mountinfo_parsing_and_classification():
    mounts = parse_mountinfo(MOUNTINFO)
    assert len(mounts) == 10
    assert Mount("/data/my bucket", "fuse.s3fs", "s3fs") in mounts and Mount("/mnt/host", "9p", "C:\\") in mounts
    expect = {"/home/me/ckpts": "ext4", "/mnt/nfs/ckpts": "nfs4", "/mnt/nfs": "nfs4", "/mnt/nfsx": "ext4",
              "/mnt/nfs/local/ckpts": "xfs", "/data/my bucket/run": "fuse.s3fs", "/mnt/share/x": "cifs",
              "/workspace/ckpts": "overlay", "/mnt/host/c": "9p", "/": "ext4"}
    for path, fstype in expect.items():
        assert mount_for(path, mounts).fstype == fstype, path
    assert mount_for("/dev/shm/x", mounts).source == "shm"  # the later mount on the same point hides the earlier
    for fstype in ("ext4", "xfs", "btrfs", "zfs", "fuseblk", "ceph"):
        assert classify(fstype) is None, fstype
    for fstype, word in (("tmpfs", "lost at reboot"), ("nfs", "export options"), ("nfs4", "export options"),
                         ("cifs", "SMB"), ("smb3", "SMB"), ("fuse.s3fs", "copy + delete"), ("fuse.sshfs", "FUSE"),
                         ("overlay", "container"), ("9p", "9p"), ("exfat", "no journal")):
        assert word in classify(fstype)[0], fstype


def test_a_network_filesystem(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "repo")
    monkeypatch.setattr(filesystem, "mount_of", lambda path: Mount("/mnt/nfs", "nfs4", "server:/export"))
    msg = line(doctor(repo, code=1), "filesystem")
    assert f"{repo} is on nfs4 (mounted at /mnt/nfs from server:/export), a network filesystem" in msg
    assert "an `async` export acknowledges fsync before the data is stored" in msg
    (f,) = by_check(doctor_json(repo, code=1), "filesystem")
    assert f["status"] == "warn" and "local disk filesystem" in f["fix"]
    ok = luopan.doctor.run_checks(repo, mount_of=lambda path: Mount("/", "xfs", "/dev/sdb"))
    assert [f.status for f in ok if f.check == "filesystem"] == ["ok"]


def test_a_real_tmpfs(monkeypatch):
    monkeypatch.undo()  # the real probe
    if not os.path.isdir("/dev/shm") or (filesystem.mount_of("/dev/shm") or EXT4).fstype != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    root = f"/dev/shm/luopan-doctor-test-{os.getpid()}"
    try:
        make_repo(root)
        msg = line(doctor(root, code=1), "filesystem")
        assert f"{root} is on tmpfs (mounted at /dev/shm" in msg and "lost at reboot" in msg
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- format version -------------------------------------------------------------------------------------------------
def test_an_older_format_version_is_fine_and_said(tmp_path):
    repo = tmp_path / "v4"
    shutil.copytree(os.path.join(DATA, "v4_repo", "plain"), repo)
    before = tree(repo)
    out = doctor(repo)
    msg = line(out, "format", "ok")
    assert f"repository format version 4, older than this luopan's {luopan.format.FORMAT_VERSION}: fine" in msg
    assert "the newest of each of 1 artifact, 2 runs, 1 journal verifies" in out
    assert tree(repo) == before


def test_doctor_never_changes_a_repository_with_problems(tmp_path):
    repo = make_repo(tmp_path / "repo")
    put_lock(str(repo), pid=dead_pid())
    (repo / "locks" / "exclusive-2222222222222222.json").write_bytes(b"junk")
    (repo / "packs" / f"x.tmp-{socket.gethostname().replace('-', '_')}-{dead_pid()}-00").write_bytes(b"x")
    before = tree(repo)
    doctor(repo, code=1)
    doctor(repo, "--full", "--json", code=1)
    assert tree(repo) == before


def test_registered_on_the_luopan_app(tmp_path):
    from luopan.cli.main import app as main_app

    res = CliRunner().invoke(main_app, ["-r", str(make_repo(tmp_path / "repo")), "doctor"])
    assert res.exit_code == 0 and "all 8 checks passed" in res.output, res.output

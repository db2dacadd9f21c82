"""Update channels (luopan.channel, docs/format.md §15): publish to a static directory, pull over a real nginx with
HTTP Range resume after a cut connection, a server restart and a killed process; the rollback and freeze rules;
unknown keys, tampered, unsigned and hostile indexes refused before anything is written; the index parser fuzzed.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import luopan
from luopan.channel import parse_index, publish, pull, read_state
from luopan.channel.index import MAX_INDEX_BYTES, format_time
from luopan.cli.main import app
from luopan.errors import CorruptChannelIndexError, UnsupportedFormatError
from luopan.format.canonical import canonical
from luopan.signing import generate_key, load_signing_key

from .conftest import ROOT
from .netcut import NetCut
from .nginx import NGINX, SKIP_REASON, Nginx

needs_nginx = pytest.mark.skipif(NGINX is None, reason=SKIP_REASON)
pull_module = importlib.import_module("luopan.channel.pull")  # the module (luopan.channel.pull is the function)
CHUNK = 256 << 10
ROWS = 256  # each tensor: 256 x 1024 float32 = 1 MiB, 4 chunks


# -- the channel all tests share: v1, v2, v3 of run-a, with a snapshot of the channel directory after each ----------
@pytest.fixture(scope="module")
def ch(tmp_path_factory):
    root = tmp_path_factory.mktemp("channel")
    generate_key(root / "keys", "release")
    generate_key(root / "rogue", "rogue")
    (root / "trusted").mkdir()
    shutil.copy(root / "keys" / "release.pub", root / "trusted" / "release.pub")
    key = load_signing_key(root / "keys" / "release.key")
    repo = luopan.open(root / "repo", chunk_size=CHUNK)
    rng = np.random.default_rng(0)
    state = {"model": {f"w{i}": rng.standard_normal((ROWS, 1024), dtype=np.float32) for i in range(4)},
             "optim": {"lr": np.float32(0.1)}}
    chan = root / "site" / "stable"
    exports, infos = {}, {}
    for step in (1, 2, 3):
        if step > 1:
            state["model"][f"w{step}"][:8] += 1.0  # one chunk of one tensor changes per step
        repo.save("run-a", step, state)
        infos[step] = publish(repo, "run-a", step, chan, sign_key=key, subtree="model")
        shutil.copytree(chan, root / f"snap-v{step}", ignore=shutil.ignore_patterns(".*"))
        exports[step] = root / f"v{step}.safetensors"
        repo.export("run-a", exports[step], step, subtree="model")
    yield SimpleNamespace(root=root, chan=chan, key=key, rogue=load_signing_key(root / "rogue" / "rogue.key"),
                          trusted=root / "trusted", repo=repo, exports=exports, infos=infos,
                          index=parse_index((chan / "index.json").read_bytes()))
    repo.close()


@pytest.fixture(autouse=True)
def no_proxy_for_loopback(monkeypatch):
    """A proxy configured in the environment (CI) must not see the requests to the test's own nginx."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"])))


@pytest.fixture
def device(tmp_path):
    d = tmp_path / "device"
    d.mkdir()
    return d


def written(d: Path) -> dict[str, bytes]:
    """Every file under a device directory, with its bytes (hidden partial files included)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def install(ch, device: Path, version: int, state: bool = True) -> Path:
    """A device holding version ``version`` (pulled whole from that snapshot of the channel, recording state)."""
    out = device / "model.safetensors"
    pull(str(ch.root / f"snap-v{version}"), None, out, trusted_keys=ch.trusted,
         state_file=device / "state.json" if state else None)
    assert out.read_bytes() == ch.exports[version].read_bytes()
    return out


def resign(ch, doc: dict, key=None) -> bytes:
    """``doc`` (an index's members) signed again, as canonical JSON: the publisher's key unless another is given."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return canonical({**body, "signature": (key or ch.key).sign(canonical(body))})


def index_doc(ch) -> dict:
    return json.loads((ch.chan / "index.json").read_bytes())


def serve_index(tmp_path: Path, data: bytes) -> Path:
    """A channel directory holding only ``data`` as its index (pulls that refuse it never fetch more)."""
    d = tmp_path / "served"
    d.mkdir(exist_ok=True)
    (d / "index.json").write_bytes(data)
    return d


# -- publish ---------------------------------------------------------------------------------------------------------
def test_publish_writes_a_signed_channel_with_patches_to_the_newest(ch):
    idx = ch.index
    assert idx.version == 3 and [v.version for v in idx.versions] == [1, 2, 3] and idx.subtree == "model"
    assert [(p.source, p.target) for p in idx.patches] == [(1, 3), (2, 3)]
    assert idx.chunk_size == CHUNK and idx.channel == "stable"
    listed = {f.name for f in idx.files()}
    on_disk = {f"{d}/{n}" for d in ("full", "patches") for n in os.listdir(ch.chan / d)}
    # the patch 1 -> 2, named by index 2 only, stays for one more publish (a device may be downloading it)
    assert on_disk - listed == {ch.infos[2]["patches"][0]["name"]} and listed <= on_disk
    assert ch.infos[3]["removed"] == [] and ch.infos[2]["removed"] == []
    assert (ch.chan / idx.latest.full.name).read_bytes() == ch.exports[3].read_bytes()
    assert luopan.patch.fingerprint_file(ch.exports[3], CHUNK) == idx.latest.fingerprint
    assert all(p.file.size < idx.latest.full.size / 4 for p in idx.patches)
    # the scratch space is beside the served directory, not in it, and empty
    assert not (ch.chan / ".tmp").exists() and os.listdir(ch.chan.parent / ".stable.publish-tmp") == []


def test_publishing_the_same_content_renews_the_index_only(ch, tmp_path):
    chan = tmp_path / "stable"
    shutil.copytree(ch.chan, chan)
    latest = chan / ch.index.latest.full.name
    latest.write_bytes(latest.read_bytes()[:-1] + b"\x01")  # damaged on disk: the export's same bytes replace it
    before = time.time()
    info = publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", expires="2h", keep=1)
    after = time.time()
    idx = parse_index((chan / "index.json").read_bytes())
    assert info["refreshed"] and info["index_version"] == 4 and info["version"] == 3
    assert idx.version == 4 and idx.versions == ch.index.versions and idx.patches == ch.index.patches
    assert before + 2 * 3600 - 1 <= idx.expires_at <= after + 2 * 3600 + 1  # 2 h from the publish (whole seconds)
    assert latest.read_bytes() == ch.exports[3].read_bytes()
    # the patch 1 -> 2 was named by index 2 last: index 4 deletes it (one publish after index 3 stopped naming it)
    assert info["removed"] == [ch.infos[2]["patches"][0]["name"]]
    with pytest.raises(luopan.UsageError, match="--subtree model"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key)
    with pytest.raises(luopan.UsageError, match="keep"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", keep=-1)
    with pytest.raises(luopan.UsageError, match="expire"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", expires="0.5s")


def test_keep_limits_the_patches_and_their_sources(ch, tmp_path):
    chan = tmp_path / "k1"
    for step in (1, 2, 3):
        publish(ch.repo, "run-a", step, chan, sign_key=ch.key, subtree="model", keep=1)
    idx = parse_index((chan / "index.json").read_bytes())
    assert [v.version for v in idx.versions] == [2, 3] and [(p.source, p.target) for p in idx.patches] == [(2, 3)]
    # version 1's full file was named by index 2, so it stays until the next publish
    assert len(os.listdir(chan / "full")) == 3
    publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", keep=1)
    assert sorted(os.listdir(chan / "full")) == sorted(v.full.name.split("/")[1] for v in idx.versions)


def test_one_publish_at_a_time(ch, tmp_path):
    from luopan.channel.files import publish_lock

    chan = tmp_path / "locked"
    chan.mkdir()
    with publish_lock(str(chan)):
        with pytest.raises(luopan.LockedError, match="another `luopan publish`"):
            publish(ch.repo, "run-a", 1, chan, sign_key=ch.key, subtree="model")
    assert not (chan / "index.json").exists()


def test_the_served_tree_holds_no_lock_file(ch, tmp_path):
    chan = tmp_path / "served"
    publish(ch.repo, "run-a", 1, chan, sign_key=ch.key, subtree="model")
    publish(ch.repo, "run-a", 2, chan, sign_key=ch.key, subtree="model")
    served = sorted(os.path.relpath(os.path.join(d, f), chan) for d, _, fs in os.walk(chan) for f in fs)
    assert [p for p in served if os.path.basename(p).startswith(".")] == [], served
    assert sorted({p.split(os.sep)[0] for p in served}) == ["full", "index.json", "patches"]


def test_an_older_publishers_lock_file_still_keeps_a_publish_out(ch, tmp_path):
    chan = tmp_path / "old"
    chan.mkdir()
    with open(chan / ".publish.lock", "w") as held:  # an older luopan publishing now holds its lock file
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(luopan.LockedError, match="another `luopan publish`"):
            publish(ch.repo, "run-a", 1, chan, sign_key=ch.key, subtree="model")
    assert not (chan / "index.json").exists()
    publish(ch.repo, "run-a", 1, chan, sign_key=ch.key, subtree="model")  # released: the publish goes ahead


# -- pull over nginx ---------------------------------------------------------------------------------------------------
@needs_nginx
def test_a_device_with_v1_pulls_v3_through_the_patch(ch, device):
    base = install(ch, device, 1)
    with Nginx(ch.chan) as web:
        out = device / "new.safetensors"
        got = pull(web.url, base, out, trusted_keys=ch.trusted, state_file=device / "state.json")
        log = web.requests(at_least=2)
    patch = ch.index.patch_from(1)
    assert got["kind"] == "patch" and got["from_version"] == 1 and got["version"] == 3
    assert got["matched_by"] == "state" and got["downloaded"] == patch.file.size
    assert out.read_bytes() == ch.exports[3].read_bytes()
    assert [(p, s) for p, s, _n, _r in log] == [("/index.json", 200), ("/" + patch.file.name, 200)]
    assert sum(n for _p, _s, n, _r in log) <= patch.file.size + 4096  # the index and the patch, nothing else
    st = read_state(device / "state.json")
    assert (st.index_version, st.version, st.fingerprint) == (3, 3, ch.index.latest.fingerprint)
    assert not [n for n in os.listdir(device) if n.endswith(".part")]
    # the same command again: the output is up to date (the state file names it), nothing is written
    before = written(device)
    again = pull(str(ch.chan), base, out, trusted_keys=ch.trusted, state_file=device / "state.json")
    assert again["up_to_date"] and again["downloaded"] == 0 and written(device) == before


@needs_nginx
def test_a_device_without_state_is_matched_by_its_base_fingerprint(ch, device):
    base = device / "base.safetensors"
    shutil.copy(ch.exports[2], base)
    with Nginx(ch.chan) as web:
        got = pull(web.url + "/", base, base, trusted_keys=ch.trusted)  # in place
    assert (got["matched_by"], got["from_version"], got["kind"]) == ("fingerprint", 2, "patch")
    assert got["downloaded"] == ch.index.patch_from(2).file.size
    assert base.read_bytes() == ch.exports[3].read_bytes()


def test_an_unknown_base_gets_the_full_file_from_a_directory(ch, device):
    base = device / "base.safetensors"
    luopan.open(device / "r", chunk_size=CHUNK).save("x", 1, {"model": {"w0": np.zeros((4, 4), np.float32)}})
    luopan.open(device / "r").export("x", base, 1, subtree="model")
    got = pull(str(ch.chan), base, device / "new.safetensors", trusted_keys=ch.trusted)
    assert got["kind"] == "full" and got["from_version"] is None and got["downloaded"] == ch.index.latest.full.size
    assert (device / "new.safetensors").read_bytes() == ch.exports[3].read_bytes()


@needs_nginx
def test_a_cut_connection_resumes_with_only_the_rest(ch, device):
    full = ch.index.latest.full
    out = device / "new.safetensors"
    with Nginx(ch.chan, limit_rate="16m") as web, NetCut("127.0.0.1", web.port) as net:
        def cut_halfway(phase, done, total):
            if done >= total // 2 and not net.is_down:
                net.cut()

        with pytest.raises(luopan.ChannelDownloadError, match="run the pull again"):
            pull(net.url, None, out, trusted_keys=ch.trusted, retries=0, progress=cut_halfway)
        part = [p for p in device.iterdir() if p.name.endswith(".part")]
        assert len(part) == 1 and full.size // 2 <= part[0].stat().st_size < full.size and not out.exists()
        have = part[0].stat().st_size
        net.restore()
        got = pull(net.url, None, out, trusted_keys=ch.trusted, retries=0)
        ranged = [r for r in web.requests(at_least=4) if r[3] != "-"]
    assert got["resumed_from"] == have and got["downloaded"] == full.size - have
    assert [r[1:] for r in ranged] == [(206, full.size - have, f"bytes={have}-")]
    assert out.read_bytes() == ch.exports[3].read_bytes()
    assert not [p for p in device.iterdir() if p.name.endswith(".part")]


@needs_nginx
def test_a_server_restart_mid_download_resumes(ch, device):
    full = ch.index.latest.full
    out = device / "new.safetensors"
    with Nginx(ch.chan, limit_rate="8m") as web:
        def crash_halfway(phase, done, total):
            if done >= total // 2 and web.proc is not None:
                web.kill()

        with pytest.raises(luopan.ChannelDownloadError):
            pull(web.url, None, out, trusted_keys=ch.trusted, retries=0, progress=crash_halfway)
        with pytest.raises(luopan.ChannelDownloadError, match="cannot fetch"):  # the server is down
            pull(web.url, None, out, trusted_keys=ch.trusted, retries=0)
        have = next(p for p in device.iterdir() if p.name.endswith(".part")).stat().st_size
        web.start()  # same port, same files
        got = pull(web.url, None, out, trusted_keys=ch.trusted, retries=0)
    assert 0 < have < full.size and got["resumed_from"] == have and got["downloaded"] == full.size - have
    assert out.read_bytes() == ch.exports[3].read_bytes()


@needs_nginx
def test_a_pull_killed_at_half_downloads_only_the_rest(ch, device, child_env):
    full = ch.index.latest.full
    out = device / "new.safetensors"
    with Nginx(ch.chan, limit_rate="2m") as web:
        cmd = [sys.executable, "-c", "from luopan.cli.main import main; main()", "pull", web.url, "-o", str(out),
               "--trusted-keys", str(ch.trusted)]
        proc = subprocess.Popen(cmd, env=child_env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        have = 0
        while time.monotonic() < deadline and proc.poll() is None:
            parts = [p for p in device.iterdir() if p.name.endswith(".part")]
            have = parts[0].stat().st_size if parts else 0
            if have >= full.size // 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
        have = next(p for p in device.iterdir() if p.name.endswith(".part")).stat().st_size
        assert full.size // 2 <= have < full.size and not out.exists()
        got = pull(web.url, None, out, trusted_keys=ch.trusted, retries=0)
    assert got["resumed_from"] == have and got["downloaded"] == full.size - have
    assert out.read_bytes() == ch.exports[3].read_bytes()


@needs_nginx
def test_a_server_that_ignores_range_restarts_the_partial_file_cleanly(ch, device):
    full = ch.index.latest.full
    out = device / "new.safetensors"
    # a partial download of another attempt, with garbage in it: the server's whole file replaces it
    partial = device / f".new.safetensors.{full.blake3[:16]}.part"
    partial.write_bytes(b"\xee" * (full.size // 3))
    with Nginx(ch.chan, ignore_range=True) as web:
        got = pull(web.url, None, out, trusted_keys=ch.trusted, retries=0)
    assert got["restarts"] == 1 and got["downloaded"] == full.size
    assert out.read_bytes() == ch.exports[3].read_bytes()


@pytest.mark.parametrize("left", [2, 1], ids=["half", "whole-size"])
def test_a_damaged_partial_file_is_caught_and_downloaded_anew(ch, device, left):
    """What a power loss can leave of a partial file (zeroed pages, of any length up to the whole file) fails the
    BLAKE3 check once complete; those bytes were the device's own, not the server's, so the same pull downloads the
    file again from zero (a rerun after a power loss succeeds: tests/test_powerloss_ship.py)."""
    full = ch.index.latest.full
    out = device / "new.safetensors"
    partial = device / f".new.safetensors.{full.blake3[:16]}.part"
    partial.write_bytes(b"\x00" * (full.size // left))
    got = pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
    assert got["downloaded"] == full.size - full.size // left + full.size and got["resumed_from"] == full.size // left
    assert out.read_bytes() == ch.exports[3].read_bytes() and not partial.exists()


def test_a_partial_file_whose_fsync_failed_is_deleted_not_trusted(ch, device, monkeypatch):
    """After a failed fsync the kernel may mark the lost pages clean, so a rerun would hash the page cache rather
    than the disk: the partial file is deleted, the pull fails naming it, and the rerun downloads it anew."""
    download_module = importlib.import_module("luopan.channel.download")
    full = ch.index.latest.full
    out = device / "new.safetensors"
    partial = device / f".new.safetensors.{full.blake3[:16]}.part"
    real_fsync = os.fsync

    def failing_fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(partial):
            raise OSError(5, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(download_module.os, "fsync", failing_fsync)
    with pytest.raises(luopan.StorageError, match=r"\.part.*partial file was deleted"):
        pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
    monkeypatch.undo()
    assert not partial.exists() and not out.exists()
    got = pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
    assert got["downloaded"] == full.size and got["resumed_from"] == 0
    assert out.read_bytes() == ch.exports[3].read_bytes()


def test_a_file_removed_by_a_later_publish_makes_the_pull_read_the_index_again(ch, tmp_path, device):
    chan = tmp_path / "live"
    shutil.copytree(ch.chan, chan)
    state = ch.repo.load("run-a", 3)
    state["model"]["w0"][:8] += 2.0
    ch.repo.save("run-a", 4, state)
    base = device / "base.safetensors"
    shutil.copy(ch.exports[1], base)
    published = []

    def publish_meanwhile(phase, done, total):
        if not published:  # after the index was read, before the patch 1 -> 3 is fetched: two publishes remove it
            published.append(publish(ch.repo, "run-a", 4, chan, sign_key=ch.key, subtree="model"))
            published.append(publish(ch.repo, "run-a", 4, chan, sign_key=ch.key, subtree="model"))  # a renewal
            assert ch.index.patch_from(1).file.name in published[-1]["removed"]

    got = pull(str(chan), base, device / "new.safetensors", trusted_keys=ch.trusted, progress=publish_meanwhile)
    assert (got["index_version"], got["version"], got["from_version"], got["kind"]) == (5, 4, 1, "patch")
    ch.repo.export("run-a", tmp_path / "v4.safetensors", 4, subtree="model")
    assert (device / "new.safetensors").read_bytes() == (tmp_path / "v4.safetensors").read_bytes()


def test_two_pulls_into_one_output_do_not_interleave(ch, device):
    import fcntl

    partial = device / f".new.safetensors.{ch.index.latest.full.blake3[:16]}.part"
    with open(partial, "wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(luopan.LockedError, match="another pull"):
            pull(str(ch.chan), None, device / "new.safetensors", trusted_keys=ch.trusted)
    assert not (device / "new.safetensors").exists()


# -- rollback, freeze, keys -------------------------------------------------------------------------------------------
def refused(ch, device: Path, url, error, match: str, state: bool = True) -> None:
    """A pull from ``url`` fails with ``error`` and leaves the device's files exactly as they were."""
    out = device / "model.safetensors"
    before = written(device)
    with pytest.raises(error, match=match):
        pull(str(url), out, out, trusted_keys=ch.trusted, state_file=device / "state.json" if state else None)
    assert written(device) == before


def test_a_replayed_old_index_is_refused(ch, device, tmp_path):
    install(ch, device, 3)
    refused(ch, device, ch.root / "snap-v2", luopan.ChannelRollbackError, "older than version 3")
    doc = index_doc(ch)  # the same version with other contents
    doc["expires"] = format_time(time.time() + 3600)
    refused(ch, device, serve_index(tmp_path, resign(ch, doc)), luopan.ChannelRollbackError, "other contents")
    doc.update(channel="beta", version=9)
    refused(ch, device, serve_index(tmp_path, resign(ch, doc)), luopan.ChannelRollbackError, "another channel")


def test_an_expired_index_is_refused(ch, device, tmp_path):
    install(ch, device, 1)
    doc = index_doc(ch)
    doc.update(created=format_time(time.time() - 7200), expires=format_time(time.time() - 60))
    refused(ch, device, serve_index(tmp_path, resign(ch, doc)), luopan.ChannelExpiredError, "expired")


def test_unknown_key_tampered_and_unsigned_indexes_are_refused(ch, device, tmp_path):
    install(ch, device, 1)
    doc = index_doc(ch)
    refused(ch, device, serve_index(tmp_path, resign(ch, doc, ch.rogue)), luopan.UntrustedKeyError, "not among")
    tampered = dict(doc, versions=[dict(v, step=v["step"] + 100) for v in doc["versions"]])
    refused(ch, device, serve_index(tmp_path, canonical(tampered)), luopan.SignatureError, "does not verify")
    unsigned = {k: v for k, v in doc.items() if k != "signature"}
    refused(ch, device, serve_index(tmp_path, canonical(unsigned)), luopan.UnsignedError, "not signed")
    with pytest.raises(luopan.UsageError, match="trusted keys"):
        pull(str(ch.chan), None, device / "x.safetensors", trusted_keys=None)


UNSAFE = "has an unsafe name"
SIZE_RANGE = "not an integer from 1 to"
UNTERMINATED = [  # unterminated strings of 1 MiB: a scan that retries each quote to the end takes minutes on them
    ("unterminated string of escaped quotes", b'{"a":"' + b'\\"' * ((MAX_INDEX_BYTES - 8) // 2)),
    ("an unterminated string in a list", b'["' + b'\\"' * ((MAX_INDEX_BYTES - 8) // 2)),
    ("quote and backslash pairs", b'{"a":' + b'"\\' * ((MAX_INDEX_BYTES - 8) // 2)),
    ("brackets in an unterminated string", b'{"a":"' + b'\\"[{' * ((MAX_INDEX_BYTES - 8) // 4)),
]


def hostile_docs(ch) -> list[tuple[str, bytes, str]]:
    """(what, index bytes, a fragment of the message that says which check refused it) of hostile indexes; those
    that can be are properly signed, so it is the parser that refuses them and not the signature check."""
    doc = index_doc(ch)
    v3 = doc["versions"][-1]

    def with_(**patch_of):
        d = json.loads(json.dumps(doc))
        for where, change in patch_of.items():
            target = {"latest": d["versions"][-1], "full": d["versions"][-1]["full"], "patch": d["patches"][0],
                      "index": d}[where]
            target.update(change)
        return resign(ch, d)

    body = canonical(doc)
    return [
        *[(f"name {n!r}", with_(full={"name": n}), f"full file {UNSAFE}") for n in
          ("../../etc/passwd", "/etc/passwd", "full/../../x", "..", ".hidden", "full/a/b", "full\\..\\x",
           "%2e%2e/x", "full/x\x00", "")],
        *[(f"patch name {n!r}", with_(patch={"name": n}), f"patch 1->3 {UNSAFE}")
          for n in ("../index.json", "patches/../../y")],
        ("huge full size", with_(full={"size": 1 << 60}), f"full file's size is 1152921504606846976, {SIZE_RANGE}"),
        ("huge patch size", with_(patch={"size": 10**30}), "patch 1->3's size is 1000000000"),
        ("negative size", with_(patch={"size": -1}), f"size is -1, {SIZE_RANGE}"),
        ("bool size", with_(full={"size": True}), f"size is True, {SIZE_RANGE}"),
        ("float version", with_(index={"version": 3.0}), "version is 3.0, not an integer"),
        ("unknown member", with_(index={"mirror": "http://evil"}), "unknown ['mirror']"),
        ("patch to an old version", with_(patch={"to": 2}), "a patch goes from version 1 to 2"),
        ("bad blake3", with_(full={"blake3": "zz" * 32}), "blake3 is not 64 hex digits"),
        ("versions out of order", resign(ch, dict(doc, versions=doc["versions"][::-1])),
         "not listed in increasing order"),
        ("two entries one file", with_(patch={"name": v3["full"]["name"]}), "two entries name the same file"),
        ("duplicate key", body[:-1] + b',"version":4}', "duplicate key 'version'"),
        ("duplicate key inside", body.replace(b'"from":1,', b'"from":1,"from":2,', 1), "duplicate key 'from'"),
        ("deep nesting", b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested more than 4 levels"),
        ("nesting in a member", with_(index={"subtree": [[[[["model"]]]]]}), "nested more than 4 levels"),
        ("oversize", b'{"pad":"' + b"x" * MAX_INDEX_BYTES + b'"}', "over the 1048576-byte limit"),
        ("not canonical", json.dumps(json.loads(resign(ch, doc)), indent=1).encode(), "not in canonical JSON form"),
        ("not JSON", b"\xff\xfe<html>", "not valid JSON"),
        ("truncated", resign(ch, doc)[:-40], "not valid JSON"),
        *[(what, data, "not valid JSON") for what, data in UNTERMINATED],
        ("p1 from unlisted version", with_(patch={"from": 77}), "a patch goes from version 77 to 3"),
        ("expired before created", with_(index={"expires": "2000-01-01T00:00:00Z"}), "before it was created"),
        ("bad time", with_(index={"expires": "tomorrow"}), "expires is not a UTC time"),
        ("no versions", resign(ch, dict(doc, versions=[], patches=[])), "it lists no version"),
        ("bad fingerprint", with_(latest={"fingerprint": "md5:" + "0" * 32}), "fingerprint is not 'blake3:'"),
        ("bad run", with_(latest={"run": "../x"}), "run is not a valid run name"),
        ("zero size", with_(patch={"size": 0}), f"size is 0, {SIZE_RANGE}"),
    ]


def test_hostile_indexes_are_refused_before_anything_is_written(ch, device, tmp_path):
    out = install(ch, device, 1)
    for what, data, message in hostile_docs(ch):
        try:
            refused(ch, device, serve_index(tmp_path, data), CorruptChannelIndexError,
                    "refused: .*" + re.escape(message))
        except BaseException as exc:
            raise AssertionError(f"hostile index {what!r} was not refused as expected: {exc!r}") from exc
    assert out.read_bytes() == ch.exports[1].read_bytes()
    doc = index_doc(ch)
    refused(ch, device, serve_index(tmp_path, resign(ch, dict(doc, format_version=2))), UnsupportedFormatError,
            "newer")


def test_an_unterminated_string_is_scanned_in_one_pass():
    """The nesting scan runs before the parser, on unverified bytes: it must be linear. A quadratic one takes
    minutes on each of these (this test would hang), the linear one a fraction of a second."""
    from luopan.channel.index import _depth

    for what, data in UNTERMINATED:
        assert len(data) <= MAX_INDEX_BYTES and len(data) > MAX_INDEX_BYTES - 16, what
        assert _depth(data) == 1, what
        with pytest.raises(CorruptChannelIndexError, match="not valid JSON"):
            parse_index(data)
    assert _depth(b'{"a":"[[[[[[","b":[[["\\"]"]]]}') == 4  # brackets in strings do not count


@needs_nginx
def test_an_oversize_index_is_not_read_whole_over_http(ch, device, tmp_path):
    served = serve_index(tmp_path, b" " * (64 << 20))
    install(ch, device, 1)
    with Nginx(served) as web:
        refused(ch, device, web.url, CorruptChannelIndexError, "over the")
        assert web.requests(at_least=1)[-1][2] < 64 << 20  # the device stopped reading after the limit


def test_a_declared_size_beyond_the_free_space_is_refused(ch, device, tmp_path):
    install(ch, device, 1)
    doc = index_doc(ch)
    doc["versions"][-1]["full"]["size"] = 1 << 41  # within the format's limit, beyond this disk
    doc["patches"] = []
    refused(ch, device, serve_index(tmp_path, resign(ch, doc)), luopan.InsufficientSpaceError, "free")


def test_a_damaged_state_file_is_refused(ch, device):
    install(ch, device, 1)
    state = device / "state.json"
    state.write_bytes(state.read_bytes().replace(b'"version":1', b'"version":3'))
    with pytest.raises(luopan.ChannelStateError, match="damaged"):
        pull(str(ch.chan), device / "model.safetensors", device / "n.safetensors", trusted_keys=ch.trusted,
             state_file=state)


# -- publish over a channel it cannot vouch for ------------------------------------------------------------------------
def channel_copy(ch, tmp_path: Path, name: str = "stable") -> Path:
    chan = tmp_path / name
    shutil.copytree(ch.chan, chan)
    return chan


def unchanged(chan: Path):
    """A check that nothing under the channel directory changed (files and their bytes)."""
    before = written(chan)
    return lambda: written(chan) == before


def test_publish_refuses_an_index_it_cannot_verify(ch, tmp_path):
    chan = channel_copy(ch, tmp_path)
    doc = index_doc(ch)
    # the reviewer's case: an unsigned index naming a planted full file, which a renewal would have signed
    (chan / "full" / "evil.safetensors").write_bytes(b"evil")
    evil = json.loads(json.dumps(doc))
    evil["versions"][-1]["full"].update(name="full/evil.safetensors", size=4, blake3="e" * 64)
    del evil["signature"]
    (chan / "index.json").write_bytes(canonical(evil))
    same = unchanged(chan)
    with pytest.raises(luopan.UnsignedError, match="never writes an unsigned index"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")
    assert same()
    # signed by another key: refused, unless that key is given as trusted (moving the channel to a new key)
    (chan / "index.json").write_bytes(resign(ch, doc, ch.rogue))
    same = unchanged(chan)
    with pytest.raises(luopan.UntrustedKeyError, match="--trusted-keys"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")
    assert same()
    info = publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", trusted_keys=ch.root / "rogue")
    new = parse_index((chan / "index.json").read_bytes())
    assert info["refreshed"] and new.version == 4 and new.signature["key_id"] == ch.key.key_id
    # changed after it was signed
    (chan / "index.json").write_bytes(canonical(dict(doc, version=9)))
    with pytest.raises(luopan.SignatureError, match="changed after it was signed"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")


def test_publish_refuses_to_keep_a_file_that_is_not_what_the_index_lists(ch, tmp_path):
    chan = channel_copy(ch, tmp_path)
    old_full = chan / ch.index.versions[0].full.name
    old_full.write_bytes(b"\x00" + old_full.read_bytes()[1:])  # same size, other bytes
    state = ch.repo.load("run-a", 3)
    state["model"]["w1"][:4] += 3.0
    ch.repo.save("run-a", 5, state)
    same = unchanged(chan)
    with pytest.raises(luopan.IntegrityError, match=r"00000001-.*does not have the BLAKE3 listed"):
        publish(ch.repo, "run-a", 5, chan, sign_key=ch.key, subtree="model")
    assert same()
    old_full.unlink()
    with pytest.raises(luopan.IntegrityError, match="is missing"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")  # a renewal checks every file too


def test_a_channel_that_lost_its_index_needs_min_version(ch, tmp_path):
    chan = channel_copy(ch, tmp_path)
    (chan / "index.json").unlink()
    with pytest.raises(luopan.UsageError, match=r"--min-version N.*more than 3"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")
    assert not (chan / "index.json").exists()
    with pytest.raises(luopan.UsageError, match="min_version"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", min_version=0)
    info = publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", min_version=50)
    idx = parse_index((chan / "index.json").read_bytes())
    assert info["index_version"] == idx.version == 50 and [v.version for v in idx.versions] == [50]
    assert sorted(os.listdir(chan / "full")) == [idx.latest.full.name.split("/")[1]]
    assert os.listdir(chan / "patches") == []
    again = publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", min_version=7)
    assert again["index_version"] == 51  # min_version never lowers the count


def test_a_min_version_publish_over_a_lost_index_cut_short_keeps_the_guard(ch, tmp_path, monkeypatch):
    """Only a channel nothing was published into gets the first-publish mark: a --min-version publish over a lost
    index that fails midway must not leave one, or a plain publish would then restart the version count at 1 and
    delete the files devices were told about."""
    import importlib

    publish_module = importlib.import_module("luopan.channel.publishing")
    chan = channel_copy(ch, tmp_path)
    (chan / "index.json").unlink()

    def broken_export(*args, **kwargs):
        raise OSError(5, "simulated failure mid-publish")

    monkeypatch.setattr(publish_module, "make_scratch", broken_export)
    with pytest.raises(OSError):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model", min_version=50)
    monkeypatch.undo()
    assert not (chan / publish_module.FIRST).exists()
    with pytest.raises(luopan.UsageError, match=r"--min-version N"):
        publish(ch.repo, "run-a", 3, chan, sign_key=ch.key, subtree="model")


# -- the device's state: crashes, downgrades, wrong bases -------------------------------------------------------------
def test_a_crash_after_the_install_cannot_open_the_door_to_a_replay(ch, device, monkeypatch):
    out = install(ch, device, 1)
    real, calls = pull_module.write_state, []

    def fail_second(path, state):  # the state write after the output was renamed into place fails (a crash)
        calls.append(state)
        if len(calls) == 2:
            raise luopan.ChannelStateError("simulated crash")
        real(path, state)

    monkeypatch.setattr(pull_module, "write_state", fail_second)
    with pytest.raises(luopan.ChannelStateError, match="simulated"):
        pull(str(ch.chan), out, out, trusted_keys=ch.trusted, state_file=device / "state.json")
    monkeypatch.undo()
    assert out.read_bytes() == ch.exports[3].read_bytes()
    st = read_state(device / "state.json")
    assert (st.index_version, st.version) == (3, 1)  # the index seen was recorded before the download
    refused(ch, device, ch.root / "snap-v2", luopan.ChannelRollbackError, "older than version 3")
    got = pull(str(ch.chan), out, out, trusted_keys=ch.trusted, state_file=device / "state.json")
    assert got["up_to_date"] and got["matched_by"] == "fingerprint" and read_state(device / "state.json").version == 3


def test_an_index_whose_newest_is_older_than_the_installed_version_cannot_downgrade(ch, device, tmp_path):
    install(ch, device, 3)
    doc = json.loads((ch.root / "snap-v2" / "index.json").read_bytes())
    doc.update(version=7, expires=format_time(time.time() + 3600))  # a newer index listing only versions 1 and 2
    served = serve_index(tmp_path, resign(ch, doc))
    for name in ("full", "patches"):
        shutil.copytree(ch.root / "snap-v2" / name, served / name)
    refused(ch, device, served, luopan.ChannelRollbackError, "installed version 3 .* newer than version 2")


def test_a_pull_pinned_to_a_channel_refuses_another_even_the_first_time(ch, device):
    before = written(device)
    with pytest.raises(luopan.ChannelRollbackError, match="asks for channel 'beta'"):
        pull(str(ch.chan), None, device / "m.safetensors", trusted_keys=ch.trusted, channel="beta")
    assert written(device) == before
    got = pull(str(ch.chan), None, device / "m.safetensors", trusted_keys=ch.trusted, channel="stable")
    assert got["kind"] == "full"


def test_the_issue_command_shape_is_up_to_date_on_a_rerun(ch, device):
    """`pull --base base.st -o new.st --state S`: the rerun is up to date (the output holds the newest), and when
    the base is the newest already, the output is made from it — `-o` always exists afterwards."""
    base = install(ch, device, 1)
    new, state = device / "new.safetensors", device / "state.json"
    first = pull(str(ch.chan), base, new, trusted_keys=ch.trusted, state_file=state)
    assert first["kind"] == "patch" and new.read_bytes() == ch.exports[3].read_bytes()
    before = written(device)
    again = pull(str(ch.chan), base, new, trusted_keys=ch.trusted, state_file=state)
    assert again["up_to_date"] and again["matched_by"] == "state" and again["downloaded"] == 0
    assert written(device) == before
    nostate = pull(str(ch.chan), base, new, trusted_keys=ch.trusted)  # without state: the output's fingerprint
    assert nostate["up_to_date"] and nostate["matched_by"] == "fingerprint" and written(device) == before
    copy = device / "copy.safetensors"
    got = pull(str(ch.chan), new, copy, trusted_keys=ch.trusted, state_file=state)
    assert got["up_to_date"] and got["copied"] and got["downloaded"] == 0 and got["path"] == str(copy)
    assert copy.read_bytes() == ch.exports[3].read_bytes()
    st, cst = read_state(state), copy.stat()
    assert (st.version, st.file_size, st.file_inode) == (3, cst.st_size, cst.st_ino)


def overwrite_keeping_size_and_time(path: Path, data: bytes, same_inode: bool) -> None:
    st = path.stat()
    assert len(data) == st.st_size
    if same_inode:
        with open(path, "r+b") as f:
            f.write(data)
    else:  # a new file put in its place (cp -p, an editor's save)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_wrong_base_reached_through_the_state_file_falls_back(ch, device):
    base = install(ch, device, 1)
    state = device / "state.json"
    out = device / "new.safetensors"
    out.write_bytes(b"the previous output")
    overwrite_keeping_size_and_time(base, ch.exports[2].read_bytes(), same_inode=True)  # the state says v1: wrong
    got = pull(str(ch.chan), base, out, trusted_keys=ch.trusted, state_file=state)
    assert (got["from_version"], got["kind"], got["matched_by"]) == (2, "patch", "fingerprint")
    assert got["downloaded"] == ch.index.patch_from(1).file.size + ch.index.patch_from(2).file.size
    assert out.read_bytes() == ch.exports[3].read_bytes()
    assert not [p for p in device.iterdir() if p.name.startswith(".")]
    # a new inode with the recorded size and time is not taken for the installed file: hashed, one patch
    dev2 = device.parent / "device2"
    dev2.mkdir()
    b2 = install(ch, dev2, 1)
    overwrite_keeping_size_and_time(b2, ch.exports[2].read_bytes(), same_inode=False)
    got = pull(str(ch.chan), b2, dev2 / "new.safetensors", trusted_keys=ch.trusted, state_file=dev2 / "state.json")
    assert (got["from_version"], got["matched_by"]) == (2, "fingerprint")
    assert got["downloaded"] == ch.index.patch_from(2).file.size


def test_a_wrong_base_through_the_state_file_leaves_the_output_and_is_forgotten(ch, device, tmp_path):
    base = install(ch, device, 1)
    state = device / "state.json"
    out = device / "new.safetensors"
    out.write_bytes(b"the previous output")
    other = bytearray(ch.exports[1].read_bytes())
    other[-1] ^= 1  # a valid safetensors file of no listed version
    overwrite_keeping_size_and_time(base, bytes(other), same_inode=True)
    served = tmp_path / "nofull"
    shutil.copytree(ch.chan, served, ignore=shutil.ignore_patterns(".*"))
    (served / ch.index.latest.full.name).unlink()  # the fallback (the full file) cannot be had
    with pytest.raises(luopan.ChannelDownloadError, match="does not exist"):
        pull(str(served), base, out, trusted_keys=ch.trusted, state_file=state)
    assert out.read_bytes() == b"the previous output" and base.read_bytes() == bytes(other)
    assert read_state(state).version is None  # the wrong match is not repeated by the next pull
    got = pull(str(ch.chan), base, out, trusted_keys=ch.trusted, state_file=state)
    assert (got["kind"], got["matched_by"]) == ("full", "fingerprint")
    assert out.read_bytes() == ch.exports[3].read_bytes()


def test_a_patch_that_does_not_make_the_newest_version_never_reaches_the_output(ch, device, tmp_path):
    base = install(ch, device, 1)
    out = device / "new.safetensors"
    out.write_bytes(b"the previous output")
    doc = index_doc(ch)
    doc["versions"][-1]["fingerprint"] = "blake3:" + "ab" * 32  # the signed index and its patch disagree
    served = serve_index(tmp_path, resign(ch, dict(doc, version=4)))
    shutil.copytree(ch.chan / "patches", served / "patches")
    with pytest.raises(CorruptChannelIndexError, match="makes content blake3:"):
        pull(str(served), base, out, trusted_keys=ch.trusted)
    assert out.read_bytes() == b"the previous output"
    assert not [p for p in device.iterdir() if p.name.startswith(".new.")]


# -- partial files ---------------------------------------------------------------------------------------------------
def test_stale_partials_of_a_sibling_output_are_not_touched(ch, device):
    sibling = device / f".model.safetensors.{'a' * 16}.part"  # a download for -o model.safetensors
    sibling.write_bytes(b"sibling")
    mine_stale = device / f".model.{'b' * 16}.part"  # a download for -o model, of a file no index names now
    mine_stale.write_bytes(b"stale")
    mine_busy = device / f".model.{'c' * 16}.part"  # ... that another pull is writing
    mine_busy.write_bytes(b"busy")
    with open(mine_busy, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        pull(str(ch.chan), None, device / "model", trusted_keys=ch.trusted)
    assert sibling.read_bytes() == b"sibling" and mine_busy.read_bytes() == b"busy" and not mine_stale.exists()
    assert (device / "model").read_bytes() == ch.exports[3].read_bytes()


def test_the_partial_file_stays_locked_until_the_output_is_in_place(ch, device):
    base = install(ch, device, 1)
    partial = device / f".new.safetensors.{ch.index.patch_from(1).file.blake3[:16]}.part"
    seen = []

    def try_lock(phase, done, total):
        if phase == "apply" and not seen:
            with open(partial, "rb") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    seen.append("unlocked")
                except BlockingIOError:
                    seen.append("locked")

    pull(str(ch.chan), base, device / "new.safetensors", trusted_keys=ch.trusted, progress=try_lock)
    assert seen == ["locked"] and not partial.exists()


def test_a_partial_file_that_is_a_link_or_not_ours_is_refused(ch, device, tmp_path):
    full = ch.index.latest.full
    out = device / "new.safetensors"
    partial = device / f".new.safetensors.{full.blake3[:16]}.part"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    partial.symlink_to(victim)
    with pytest.raises(luopan.OutputPathError, match="symbolic link"):
        pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
    partial.unlink()
    os.link(victim, partial)
    with pytest.raises(luopan.OutputPathError, match="2 links"):
        pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
    assert victim.read_bytes() == b"precious" and not out.exists()
    partial.unlink()
    if os.geteuid() == 0:  # only root can give a file to another user
        partial.write_bytes(b"planted")
        os.chown(partial, 4242, 4242)
        with pytest.raises(luopan.OutputPathError, match="belongs to user 4242"):
            pull(str(ch.chan), None, out, trusted_keys=ch.trusted)
        assert partial.read_bytes() == b"planted" and not out.exists()


# -- hostile HTTP servers (a stub on 127.0.0.1) ------------------------------------------------------------------------
class Stub:
    """A small HTTP/1.1 server on 127.0.0.1 serving ``root`` (Range requests answered 206, like nginx); ``hook``
    (handler, path, bytes or None) may answer a request its own way instead (returning True)."""

    def __init__(self, root: Path, hook=None) -> None:
        stub = self
        self.root, self.hook, self.log = root, hook, []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                stub.log.append((path, self.headers.get("Range")))
                f = stub.root / path
                data = f.read_bytes() if path and f.is_file() else None
                if stub.hook is not None and stub.hook(self, path, data):
                    return
                if data is None:
                    return self.answer(404, b"")
                m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if m and int(m.group(1)) < len(data):
                    at = int(m.group(1))
                    return self.answer(206, data[at:], {"Content-Range": f"bytes {at}-{len(data) - 1}/{len(data)}"})
                self.answer(200, data)

            def answer(self, code, body, headers=None, length=None):
                self.close_connection = True
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if length is not False:
                    self.send_header("Content-Length", str(len(body) if length is None else length))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                return True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def requests(self, path: str) -> int:
        return sum(1 for p, _r in self.log if p == path)

    def __enter__(self) -> Stub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def half_partial(ch, device: Path) -> Path:
    """A partial download of the newest full file for device/new.safetensors, holding its first half."""
    full = ch.index.latest.full
    partial = device / f".new.safetensors.{full.blake3[:16]}.part"
    partial.write_bytes(ch.exports[3].read_bytes()[: full.size // 2])
    return partial


@pytest.mark.parametrize("case, message", [
    ("wrong Content-Range", "sent the range 'bytes 0-"),
    ("no Content-Range", "sent the range 'None'"),
    ("416", "HTTP 416"),
    ("200 of another length", "bytes on the server, but the index says"),
    ("tampered bytes", "have BLAKE3"),
])
def test_a_server_whose_file_is_not_the_index_s_deletes_the_partial(ch, device, case, message):
    full = ch.index.latest.full
    name = full.name
    good = ch.exports[3].read_bytes()

    def hook(h, path, data):
        if path != name:
            return False
        at = int(re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or "bytes=0-").group(1))
        if case == "wrong Content-Range":
            return h.answer(206, data[at:], {"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}"})
        if case == "no Content-Range":
            return h.answer(206, data[at:])
        if case == "416":
            return h.answer(416, b"", {"Content-Range": f"bytes */{at - 1}"})
        if case == "200 of another length":
            return h.answer(200, data[:-1] + b"\x00\x00")
        if case == "tampered bytes":  # the right size, other bytes: only the signed BLAKE3 can tell
            bad = bytearray(data)
            bad[-2] ^= 0xFF
            return h.answer(206, bytes(bad[at:]), {"Content-Range": f"bytes {at}-{len(data) - 1}/{len(data)}"})
        return False

    partial = half_partial(ch, device)
    out = device / "new.safetensors"
    out.write_bytes(b"the previous output")
    with Stub(ch.chan, hook) as web:
        with pytest.raises(luopan.CorruptDownloadError, match=re.escape(message) + ".*partial file was deleted"):
            pull(web.url, None, out, trusted_keys=ch.trusted, retries=3)
        # not retried; but bytes that only fail the BLAKE3 check once complete may be the resumed part's (what a
        # power loss left): the file is downloaded once more from zero, and refused only if that fails too
        assert web.requests(name) == (2 if case == "tampered bytes" else 1)
    assert not partial.exists() and out.read_bytes() == b"the previous output"
    assert good == ch.exports[3].read_bytes()


def test_a_server_that_compresses_is_refused_without_retries(ch, device):
    for target in ("index.json", ch.index.latest.full.name):
        def hook(h, path, data, target=target):
            if path == target:
                return h.answer(200, data, {"Content-Encoding": "gzip"})
            return False

        with Stub(ch.chan, hook) as web:
            with pytest.raises(luopan.ChannelDownloadError, match="'gzip'-encoded") as info:
                pull(web.url, None, device / "new.safetensors", trusted_keys=ch.trusted, retries=3)
            assert web.requests(target) == 1 and "run the pull again" not in str(info.value)
    assert not (device / "new.safetensors").exists()


def test_a_cut_while_reading_the_index_is_a_download_error_and_retried(ch, device, monkeypatch):
    monkeypatch.setattr(pull_module, "BACKOFF", 0.01)
    cuts = []

    def hook(h, path, data):
        if path == "index.json" and len(cuts) < 2:
            cuts.append(1)
            h.answer(200, data[: len(data) // 2], length=len(data))  # announces all, sends half, closes
            return True
        return False

    with Stub(ch.chan, hook) as web:
        with pytest.raises(luopan.ChannelDownloadError, match="cut after"):
            pull(web.url, None, device / "new.safetensors", trusted_keys=ch.trusted, retries=0)
        got = pull(web.url, None, device / "new.safetensors", trusted_keys=ch.trusted, retries=1)
        assert web.requests("index.json") == 3
    assert got["kind"] == "full" and (device / "new.safetensors").read_bytes() == ch.exports[3].read_bytes()


def test_bad_length_headers_do_not_crash(ch, device):
    name = ch.index.latest.full.name

    def hook(h, path, data):
        if path == name and h.headers.get("Range") is None:
            return h.answer(200, data, {"Content-Length": "\u00b2"}, length=False)  # a Unicode digit, no length
        if path == name:
            at = int(h.headers["Range"][6:-1])
            return h.answer(206, data[at:], {"Content-Range": f"bytes {at}-{'9' * 5000}/{len(data)}"})
        return False

    with Stub(ch.chan, hook) as web:
        got = pull(web.url, None, device / "new.safetensors", trusted_keys=ch.trusted, retries=0)
        assert got["downloaded"] == ch.index.latest.full.size
        (device / "new.safetensors").unlink()
        half_partial(ch, device)
        with pytest.raises(luopan.CorruptDownloadError, match="sent the range"):
            pull(web.url, None, device / "new.safetensors", trusted_keys=ch.trusted, retries=0)


def test_redirects_elsewhere_are_refused_without_retries(ch, device):
    from luopan.channel.source import _SafeRedirect

    def hook(h, path, data):
        port = h.server.server_address[1]
        where = {"to-other-host/index.json": f"http://localhost:{port}/index.json",
                 "to-ftp/index.json": "ftp://127.0.0.1/index.json",
                 "same-host/index.json": "/index.json"}.get(path)
        if where is None:
            return False
        return h.answer(302, b"", {"Location": where})

    out = device / "new.safetensors"
    with Stub(ch.chan, hook) as web:
        for sub, message in (("to-other-host", "on another host or port"), ("to-ftp", "not an http(s) URL")):
            with pytest.raises(luopan.ChannelDownloadError, match=re.escape(message)) as info:
                pull(f"{web.url}/{sub}", None, out, trusted_keys=ch.trusted, retries=3)
            assert "run the pull again" not in str(info.value) and web.requests(f"{sub}/index.json") == 1
        assert web.requests("index.json") == 0 and not out.exists()
        # a redirect on the same host is followed (the files are then asked for under the URL given: missing)
        with pytest.raises(luopan.ChannelDownloadError, match="404"):
            pull(f"{web.url}/same-host", None, out, trusted_keys=ch.trusted, retries=0)
        assert web.requests("index.json") >= 1
    req = urllib.request.Request("https://example.org/c/index.json")
    with pytest.raises(luopan.ChannelDownloadError, match="drop https"):
        _SafeRedirect().redirect_request(req, None, 302, "Found", {}, "http://example.org/c/index.json")
    assert _SafeRedirect().redirect_request(urllib.request.Request("http://example.org/c/index.json"), None, 302,
                                            "Found", {}, "https://example.org/d/index.json") is not None


# -- CLI ------------------------------------------------------------------------------------------------------------
def test_cli_publish_and_pull(ch, tmp_path, device):
    runner = CliRunner()
    chan = tmp_path / "cli-chan"
    for step in ("1", "3"):
        res = runner.invoke(app, ["publish", "-r", str(ch.root / "repo"), "run-a", step, "--channel", str(chan),
                                  "--sign", str(ch.root / "keys" / "release.key"), "--subtree", "model",
                                  "--expires", "7d"])
        assert res.exit_code == 0, res.output
    assert "version 2" in res.output and "patch" in res.output
    base = device / "model.safetensors"
    shutil.copy(ch.exports[1], base)
    args = ["pull", str(chan), "--base", str(base), "-o", str(base), "--trusted-keys", str(ch.trusted), "--state",
            str(device / "st.json")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "via the patch from version 1" in res.output and base.read_bytes() == ch.exports[3].read_bytes()
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "nothing to do" in res.output
    (chan / "index.json").write_bytes((chan / "index.json").read_bytes().replace(b'"step":3', b'"step":4'))
    res = runner.invoke(app, args)
    assert res.exit_code == 3 and "does not verify" in res.output
    res = runner.invoke(app, ["publish", "--help"])
    assert res.exit_code == 0 and all(o in res.output for o in ("--keep", "--expires", "--min-version",
                                                                 "--trusted-keys"))
    res = runner.invoke(app, ["pull", str(ch.chan), "-o", str(device / "x.safetensors"), "--trusted-keys",
                              str(ch.trusted), "--channel", "beta"])
    assert res.exit_code != 0 and "asks for channel 'beta'" in res.output
    (chan / "index.json").unlink()
    res = runner.invoke(app, ["publish", "-r", str(ch.root / "repo"), "run-a", "3", "--channel", str(chan),
                              "--sign", str(ch.root / "keys" / "release.key"), "--subtree", "model",
                              "--min-version", "9"])
    assert res.exit_code == 0 and "as version 9 of channel" in res.output, res.output


# -- fuzz -----------------------------------------------------------------------------------------------------------
HOSTILE_VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                           st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                           st.sampled_from(["..", "../x", "full/../x", "/abs", "a" * 300, "blake3:" + "f" * 64]),
                           st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                max_size=2))


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _parse(data: bytes) -> None:
    try:
        idx = parse_index(data)
    except (CorruptChannelIndexError, UnsupportedFormatError):
        return
    assert all(".." not in f.name and not f.name.startswith("/") for f in idx.files())


def test_fuzz_the_index_parser(ch):
    valid = (ch.chan / "index.json").read_bytes()
    doc = json.loads(valid)
    paths = list(_paths(doc))[1:]
    fuzz = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    @fuzz
    @given(st.binary(max_size=512))
    def random_bytes(data):
        _parse(data)

    @fuzz
    @given(st.integers(0, len(valid) - 1), st.binary(min_size=0, max_size=8), st.integers(0, 8))
    def byte_mutations(at, insert, drop):
        _parse(valid[:at] + insert + valid[at + drop:])

    @fuzz
    @given(st.sampled_from(paths), HOSTILE_VALUES, st.booleans())
    def structural(path, value, delete):
        d = json.loads(valid)
        target = d
        for p in path[:-1]:
            target = target[p]
        if delete and isinstance(target, dict):
            del target[path[-1]]
        else:
            target[path[-1]] = value
        try:
            data = canonical(d)
        except (TypeError, ValueError):
            return
        _parse(data)

    random_bytes()
    byte_mutations()
    structural()

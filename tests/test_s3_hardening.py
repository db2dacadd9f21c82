"""S3 hardening, against a real S3-protocol server (moto's standalone server, tests/s3server.py):

* a stray object whose name is not a valid key (``index//x.json``, ``locks/../y.json`` …), which any S3 client can
  create under a repository's prefix, must not break saves, listings, verify, gc or the CLI;
* a save cut off by a real network outage (a TCP proxy, tests/netcut.py, resets every connection) must fail
  cleanly, and its shared lock record must be removed once the store answers again, so prune/gc are not blocked.
"""

from __future__ import annotations

import threading
import time
import warnings
from urllib.parse import urlsplit

import boto3
import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
import luopan.checkpoint.saving as repo_module
import luopan.repository.locks as locks_module
from luopan.cli.main import app
from luopan.errors import LuopanError
from luopan.repository.locks import list_locks
from luopan.retention import KeepLast
from luopan.store import FsspecStore
from luopan.store.fsspec_store import ObjectStoreError

from .netcut import NetCut
from .s3server import BUCKET, fresh_url, s3_endpoint  # noqa: F401  (s3_endpoint is a fixture)

# Object names under the repository prefix that are not valid store keys (an empty, "." or ".." part). None of them
# is luopan's; each sits where luopan lists (index/, locks/, runs/, packs/).
STRAY_KEYS = [
    "index//x.json",
    "index/../x.json",
    "index/./i.json",
    "locks//x.json",
    "locks/../y.json",
    "locks//shared-0123456789abcdef.json",  # named like a lock record, but not directly under locks/
    "runs/r/ckpt//00000001.json",
    "runs/r/./ckpt/00000009.json",
    "runs//ckpt/00000001.json",
    "packs/ab//x.pack",
    "packs/../p.pack",
]


def _valid_key(key: str) -> bool:
    """docs/format.md's rule for a store key: non-empty ``/``-separated parts, none of them ``.`` or ``..``."""
    return bool(key) and all(part not in ("", ".", "..") for part in key.split("/"))


def _raw_keys(endpoint: str, prefix: str) -> set[str]:
    """Every object name under ``prefix`` in BUCKET, as the server lists it (boto3, no s3fs in between)."""
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    names: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        names.update(obj["Key"][len(prefix) + 1:] for obj in page.get("Contents", []))
    return names


def _put_strays(repo: luopan.Repo, endpoint: str) -> set[str]:
    """Put every STRAY_KEYS object straight into the bucket (s3fs, bypassing luopan's key checks); returns those the
    server stored under exactly that name (a server that normalised a name away would not hold that stray)."""
    store = repo.store
    assert isinstance(store, FsspecStore)
    for key in STRAY_KEYS:
        store._fs.pipe_file(f"{store.prefix}/{key}", b"{}")
    stored = _raw_keys(endpoint, store.prefix.split("/", 1)[1])
    kept = {k for k in STRAY_KEYS if k in stored}
    # moto 5 stores all of these names verbatim (checked above, not assumed); should a server normalise "//" or
    # ".." away, that key is no stray there and is left out of the checks, rather than failing the test.
    if not kept:
        pytest.skip(f"the S3 server normalised every stray name away ({sorted(stored)}): nothing to test")
    return kept


def _netcut_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("netcut-") and t.is_alive()]


def _cli_ok(args: list[str]):
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"`luopan {' '.join(args)}` raised {result.exception!r}:\n{result.output}")
    assert result.exit_code == 0, f"`luopan {' '.join(args)}` exited {result.exit_code}:\n{result.output}"
    assert "Traceback" not in result.output, result.output
    return result


def test_stray_object_names_do_not_break_the_repository(s3_endpoint):
    """Reproduces "one stray object key breaks everything on S3": an object named ``index//x.json`` (or with a
    ``..``/``.`` part) under the repository prefix was listed as a key, and the next read of it raised
    InvalidNameError, so save, verify, gc, ls and locks all failed. Now such names are skipped by
    ``FsspecStore.list``, reported as strays, and every operation works around them (and never deletes them)."""
    url = fresh_url()
    repo = luopan.open(url)
    repo.save("r", 1, {"x": np.arange(1000, dtype=np.float32)})
    assert not any(_valid_key(k) for k in STRAY_KEYS)
    strays = _put_strays(repo, s3_endpoint)
    store = repo.store
    assert isinstance(store, FsspecStore)

    # The store's listing yields only valid keys: none of the strays, under any prefix.
    for prefix in ("", "index/", "locks/", "runs/", "runs/r/ckpt/", "packs/"):
        listed = list(store.list(prefix))
        assert all(_valid_key(k) for k in listed), listed
        assert not strays & set(listed), (prefix, listed)
    assert list(FsspecStore(url).list("locks/")) == []
    assert {s.key for s in store.strays("")} == strays

    # Saving a new step (lists index/ for deduplication, locks/ for the lock protocol) works.
    state2 = {"x": np.arange(1000, dtype=np.float32) + 1}
    repo.save("r", 2, state2)
    assert repo.runs() == ["r"]
    assert repo.steps("r") == [1, 2]
    np.testing.assert_array_equal(repo.load("r", 2)["x"], state2["x"])
    assert {s.key for s in repo.strays(everywhere=True)} == strays
    assert {s.key for s in repo.strays()} == {k for k in strays if k.startswith("runs/")}

    # A fresh open sees the same.
    again = luopan.open(url, create=False)
    assert again.runs() == ["r"] and again.steps("r") == [1, 2]
    assert list_locks(again.store) == []

    report = again.verify()
    assert report.ok and report.checkpoints == 2
    assert {s.key for s in report.strays} == strays

    again.prune("r", KeepLast(1))
    gc_report = again.gc(grace=0)
    assert gc_report.deleted_packs >= 1  # step 1's pack was freed: gc really ran past the strays
    assert again.steps("r") == [2]
    assert again.verify().ok

    # The CLI: every command a user reaches for exits 0, no traceback.
    _cli_ok(["ls", "-r", url])
    verify = _cli_ok(["verify", "-r", url])
    assert "ok: 1 checkpoint(s)" in verify.output
    assert all(k in verify.output for k in strays), verify.output  # named as "not luopan's (skipped)"
    _cli_ok(["gc", "--grace", "0", "-r", url])
    locks = _cli_ok(["locks", "-r", url])
    assert locks.output.strip() == "no locks"
    unlock = _cli_ok(["unlock", "--all", "-r", url])
    assert "0 lock(s) removed" in unlock.output

    # Nothing luopan did deleted (or "fixed") the strays: they are not luopan's.
    assert strays <= _raw_keys(s3_endpoint, store.prefix.split("/", 1)[1])
    assert luopan.open(url, create=False).steps("r") == [2]


def test_netcut_proxy_really_cuts_and_restores(s3_endpoint):
    """Self-test of tests/netcut.py: through the proxy S3 works; after cut() requests fail with a connection error
    (no response from the server at all); after restore() they work again."""
    url = fresh_url()
    parts = urlsplit(s3_endpoint)
    with NetCut(parts.hostname, parts.port) as proxy:
        store = FsspecStore(url, endpoint_url=proxy.url, key="test", secret="test", skip_instance_cache=True,
                            config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5})
        store._fs.retries = 1  # s3fs's own retry loop (a class attribute; not a constructor option)
        store.put("a", b"1")
        assert store.get("a") == b"1" and proxy.accepted >= 1
        proxy.cut()
        with pytest.raises(ObjectStoreError):
            store.get("a")
        with pytest.raises(ObjectStoreError):
            store.put("b", b"2")
        # a few connection attempts per call (its one attempt and s3fs's one retry), not a retry loop; a hang is
        # caught by the client's connect and read timeouts
        assert 1 <= proxy.refused <= 10
        proxy.restore()
        deadline = time.monotonic() + 10
        while True:  # the first request after the outage may still meet a pooled connection that was reset
            try:
                assert store.get("a") == b"1"
                break
            except ObjectStoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    assert not FsspecStore(url).exists("b")
    assert _netcut_threads() == []  # close() ended every proxy thread


def test_lock_of_a_save_cut_off_by_an_outage_is_released_when_the_store_answers(s3_endpoint, monkeypatch):
    """Reproduces "a lock leaks after an S3 outage": a save whose connection to S3 drops after it wrote its shared
    lock record (a real outage: the proxy resets every connection) failed, and its attempt to delete the record
    failed too, so the record stayed behind — a live process's shared lock, never stale — and blocked every later
    prune/gc of the repository for 30 minutes. Now the save fails cleanly (nothing committed), and the record is
    deleted in the background as soon as the store answers again, so prune/gc go ahead."""
    url = fresh_url()
    parts = urlsplit(s3_endpoint)
    proxy = NetCut(parts.hostname, parts.port)
    proxied_store = None
    try:
        repo = luopan.open(url, storage_options={
            "endpoint_url": proxy.url, "key": "test", "secret": "test", "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
        }, lock_timeout=5)
        proxied_store = repo.store
        assert isinstance(proxied_store, FsspecStore)
        proxied_store._fs.retries = 1  # s3fs retries each request 5 times by default: keep the outage fast
        direct = luopan.open(url, lock_timeout=10)  # the real endpoint, never cut

        repo.save("r", 1, {"x": np.arange(1000, dtype=np.float32)})
        assert proxy.accepted >= 1  # that save really went through the proxy

        original = repo_module.write_checkpoint
        seen_locks: list[list[str]] = []

        def outage_then_write(*args, **kwargs):
            # Here the save holds its shared lock (its record is in the store) and has written nothing else yet.
            seen_locks.append([rec.key for rec in list_locks(direct.store)])
            proxy.cut()
            return original(*args, **kwargs)

        monkeypatch.setattr(repo_module, "write_checkpoint", outage_then_write)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(LuopanError) as info:
                repo.save("r", 2, {"x": np.arange(1000, dtype=np.float32) + 1})
        monkeypatch.setattr(repo_module, "write_checkpoint", original)

        # The save failed with the store's error: a LuopanError that is also an OSError, naming the repository.
        assert isinstance(info.value, ObjectStoreError), repr(info.value)  # a StorageError: LuopanError + OSError
        assert isinstance(info.value, OSError)
        assert url in str(info.value)
        assert len(seen_locks) == 1 and len(seen_locks[0]) == 1 and seen_locks[0][0].startswith("locks/shared-")
        lock_key = seen_locks[0][0]
        assert any("could not remove repository lock" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]

        # Nothing of step 2 was committed; the record is still there while the store cannot be reached.
        assert direct.steps("r") == [1]
        assert [rec.key for rec in list_locks(direct.store)] == [lock_key]
        assert direct.verify().ok

        proxy.restore()
        deadline = time.monotonic() + 20
        while [rec.key for rec in list_locks(direct.store)]:  # the background retry removes it, unprompted
            assert time.monotonic() < deadline, f"lock record {lock_key} still there 20 s after the store came back"
            time.sleep(0.2)

        # prune and gc (exclusive locks) are not blocked; step 1 is intact, and saves through the proxy work again.
        direct.prune("r", KeepLast(1))
        direct.gc(grace=0)
        assert direct.steps("r") == [1]
        repo.save("r", 3, {"x": np.arange(1000, dtype=np.float32) + 3})
        assert direct.steps("r") == [1, 3] and direct.verify().ok
        assert list_locks(direct.store) == []
    finally:
        proxy.restore()
        pending = getattr(locks_module, "_orphans", None)
        if pending and proxied_store is not None:  # a failed run: leave no retry loop aimed at a closed proxy
            retry = getattr(locks_module, "retry_releases", None)
            if retry is not None:
                retry()
            with locks_module._orphans_lock:
                for ident in [i for i, (s, _k) in pending.items() if s is proxied_store]:
                    pending.pop(ident, None)
        proxy.close()
    assert _netcut_threads() == []

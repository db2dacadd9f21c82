"""Tiered storage (luopan.repository.tier, luopan.store.tiered, docs/format.md §10.2): local writes, background replication with verification,
status, eviction after confirmation, fallback loads, cold moves, resume after a kill, retries.

Remotes are local directories (fast) and a real S3-protocol server (moto, tests/s3server.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.checkpoint.kind import CHECKPOINTS
from luopan.cli.main import app
from luopan.errors import ConfigConflictError, InvalidNameError, LuopanError
from luopan.format.manifest import parse_manifest
from luopan.format.names import manifest_key, pack_key, pending_key, replicated_key
from luopan.repository import replication
from luopan.repository import tier as tier_mod
from luopan.repository.tiersetup import ColdPolicy
from luopan.retention import KeepLast
from luopan.store import FsspecStore, KeyNotFound, LocalStore, MemoryStore, Store
from luopan.store.tiered import TieredStore

from .conftest import PYTHON
from .helpers import assert_same_state
from .s3server import fresh_url, s3_endpoint  # noqa: F401  (s3_endpoint is a fixture)
from .store_suite import StoreSuite

SMALL = {"chunk_size": 64 * 1024, "pack_size": 256 * 1024}  # a 1 MiB state writes ~4 packs


STATE_SRC = """
import numpy as np

def make_state(step):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((512, 512), dtype=np.float32), "b": np.arange(10.0) * step, "step": step}
"""
exec(STATE_SRC)  # defines make_state, shared with the child process of the kill test


def until(cond, timeout: float = 20.0, what: str = "condition") -> None:
    """Wait (bounded) for a real condition."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Wrapped(Store):
    """A store that delegates to ``inner`` and lets a test count, fail or hold writes."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.puts: list[str] = []
        self.fail_puts = 0  # the next N writes raise OSError
        self.hold: threading.Event | None = None  # pack writes wait for it
        self.holding = threading.Event()

    def _write(self, key):
        if self.hold is not None and key.startswith("packs/"):
            self.holding.set()
            self.hold.wait()
        if self.fail_puts > 0:
            self.fail_puts -= 1
            raise OSError(5, f"injected failure writing {key}")
        self.puts.append(key)

    def put(self, key, data):
        self._write(key)
        self.inner.put(key, data)

    def put_if_absent(self, key, data):
        self._write(key)
        return self.inner.put_if_absent(key, data)

    def get(self, key):
        return self.inner.get(key)

    def get_range(self, key, offset, length):
        return self.inner.get_range(key, offset, length)

    def delete(self, key):
        self.inner.delete(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def exists(self, key):
        return self.inner.exists(key)

    def size(self, key):
        return self.inner.size(key)

    def describe(self):
        return f"wrapped:{self.inner.describe()}"


# -- the store ----------------------------------------------------------------------------------------------------
class TestTieredStore(StoreSuite):
    def make_store(self, tmp_path):
        return TieredStore(LocalStore(tmp_path / "local"), MemoryStore())


class TestTieredStoreS3(StoreSuite):
    @pytest.fixture(autouse=True)
    def _server(self, s3_endpoint):
        self.endpoint = s3_endpoint

    def make_store(self, tmp_path):
        return TieredStore(LocalStore(tmp_path / "local"), FsspecStore(fresh_url()))

    def test_matches_dict_model(self, tmp_path, monkeypatch):
        import hypothesis

        from . import store_suite

        monkeypatch.setattr(store_suite, "settings", lambda **kw: hypothesis.settings(**{**kw, "max_examples": 8}))
        super().test_matches_dict_model(tmp_path)


def test_tiered_store_falls_back_evicts_and_deletes_everywhere(tmp_path):
    local, remote, cold = LocalStore(tmp_path / "l"), MemoryStore(), MemoryStore()
    s = TieredStore(local, remote, cold)
    remote.put("packs/aa/r.pack", b"remote bytes")
    cold.put("runs/r/ckpt/00000001.json", b"cold")
    s.put("runs/r/ckpt/00000002.json", b"local")
    assert s.get("packs/aa/r.pack") == b"remote bytes" and s.get_range("packs/aa/r.pack", 7, 5) == b"bytes"
    assert s.size("packs/aa/r.pack") == 12 and s.exists("packs/aa/r.pack")
    assert s.get("runs/r/ckpt/00000001.json") == b"cold"
    assert sorted(s.list("runs/")) == ["runs/r/ckpt/00000001.json", "runs/r/ckpt/00000002.json"]
    assert not local.exists("packs/aa/r.pack")  # reads never copy into the local tier
    remote.put("runs/r/ckpt/00000002.json", b"local")
    s.evict("runs/r/ckpt/00000002.json")
    assert not local.exists("runs/r/ckpt/00000002.json") and s.get("runs/r/ckpt/00000002.json") == b"local"
    s.delete("runs/r/ckpt/00000002.json")
    assert not remote.exists("runs/r/ckpt/00000002.json") and not s.exists("runs/r/ckpt/00000002.json")
    remote.put("locks/shared-x.json", b"{}")  # locks and tier/ files belong to one store: never mixed in
    assert list(s.list("locks/")) == [] and not s.exists("locks/shared-x.json")
    with pytest.raises(KeyNotFound):
        s.get("locks/shared-x.json")


def test_unreachable_remote_answers_from_local(tmp_path):
    class Down(MemoryStore):
        def list(self, prefix=""):
            raise OSError(113, "no route to host")

        def exists(self, key):
            raise OSError(113, "no route to host")

    s = TieredStore(LocalStore(tmp_path / "l"), Down())
    s.put("runs/a.json", b"1")
    with pytest.warns(UserWarning, match="cannot be reached"):
        assert list(s.list("runs/")) == ["runs/a.json"]
    assert not s.exists("runs/b.json") and isinstance(s.remote_error, OSError)


# -- replication --------------------------------------------------------------------------------------------------
def test_replicates_verifies_and_remote_is_a_repository(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with luopan.open(local, replicate_to=str(remote), **SMALL) as repo:
        for step in range(3):
            repo.save("a", step, make_state(step))
        assert repo.wait_replicated(30)
        assert repo.replication_status("a") == {0: "replicated", 1: "replicated", 2: "replicated"}
        assert not list(LocalStore(local).list("tier/pending/"))
        assert repo.tier.sent_packs >= 3
    alone = luopan.open(remote, create=False)  # the remote is a repository on its own
    assert alone.config == luopan.open(local, replicate=False).config
    assert alone.steps("a") == [0, 1, 2]
    for step in range(3):
        assert_same_state(alone.load("a", step), make_state(step))
    assert alone.verify().checkpoints == 3
    assert LocalStore(remote).exists("runs/a/record.json")
    assert list(LocalStore(remote).list("index/"))  # index files follow their packs
    assert not [k for k in LocalStore(remote).list("locks/") if k.endswith(".json")]  # the shared lock is released


def test_status_local_replicating_replicated(tmp_path):
    remote = Wrapped(LocalStore(tmp_path / "remote"))
    remote.hold = threading.Event()
    repo = luopan.open(tmp_path / "local", replicate_to=remote, **SMALL)
    try:
        repo.save("a", 0, make_state(0))
        repo.save("a", 1, make_state(1))
        until(remote.holding.is_set, what="the first pack upload")
        st = repo.replication_status("a")
        assert st == {0: "replicating", 1: "local"}
        assert not remote.inner.exists(manifest_key("a", 0))  # the manifest goes last
        remote.hold.set()
        assert repo.wait_replicated(30)
        assert repo.replication_status("a") == {0: "replicated", 1: "replicated"}
    finally:
        remote.hold.set()
        repo.close()


def test_save_pauses_replication(tmp_path):
    """While a save writes, no pack upload starts (the training loop gets the machine)."""
    remote = Wrapped(LocalStore(tmp_path / "remote"))
    repo = luopan.open(tmp_path / "local", replicate_to=remote, replicate=False, **SMALL)
    repo.save("a", 0, make_state(0))
    with repo.tier.saving():
        repo.tier.start()
        time.sleep(0.3)  # give the thread a chance to (wrongly) upload
        assert not any(k.startswith("packs/") for k in remote.puts)
    assert repo.wait_replicated(30)
    assert any(k.startswith("packs/") for k in remote.puts)
    repo.close()


def test_transient_failures_are_retried_with_backoff(tmp_path):
    remote = Wrapped(LocalStore(tmp_path / "remote"))
    remote.fail_puts = 4
    with pytest.warns(UserWarning, match="cannot be reached"):  # the remote refuses writes from the start
        repo = luopan.open(tmp_path / "local", replicate_to=remote, replicate=False, **SMALL)
    repo.tier.backoff_initial = 0.01
    repo.save("a", 0, make_state(0))
    t0 = time.monotonic()
    repo.tier.start()
    assert repo.wait_replicated(30)
    assert remote.fail_puts == 0 and isinstance(repo.tier.last_error, OSError)
    assert time.monotonic() - t0 >= 0.01 * (1 + 2 + 4) * 0.75  # backed off between attempts
    assert repo.replication_status("a") == {0: "replicated"}
    assert luopan.open(remote.inner, create=False).verify().checkpoints == 1
    repo.close()


def test_bad_pack_on_remote_is_detected_and_resent(tmp_path):
    """Verification reads back what landed: a pack that lands damaged is written again."""

    class Mangling(Wrapped):
        mangled = 0

        def put_if_absent(self, key, data):
            if key.startswith("packs/") and not self.mangled:
                self.mangled += 1
                data = b"".join(bytes(p) for p in ([data] if isinstance(data, (bytes, bytearray)) else data))
                self.inner.put(key, data[:-1] + bytes([data[-1] ^ 1]))
                return True
            return super().put_if_absent(key, data)

    remote = Mangling(LocalStore(tmp_path / "remote"))
    repo = luopan.open(tmp_path / "local", replicate_to=remote, replicate=False, **SMALL)
    repo.tier.backoff_initial = 0.01
    repo.save("a", 0, make_state(0))
    repo.tier.start()
    assert repo.wait_replicated(30)
    assert "did not land intact" in str(repo.tier.last_error)
    assert luopan.open(remote.inner, create=False).verify().checkpoints == 1
    repo.close()


def test_eviction_only_after_confirmation_and_load_falls_back(tmp_path):
    remote = Wrapped(LocalStore(tmp_path / "remote"))
    remote.fail_puts = 10**9  # the remote refuses everything for now
    with pytest.warns(UserWarning, match="cannot be reached"):  # the remote refuses writes from the start
        repo = luopan.open(tmp_path / "local", replicate_to=remote, local_retention=KeepLast(1), **SMALL)
    repo.tier.backoff_initial = repo.tier.backoff_max = 0.01
    for step in range(3):
        repo.save("a", step, make_state(step))
    until(lambda: repo.tier.last_error is not None, what="a failed attempt")
    local = LocalStore(tmp_path / "local")
    assert repo.tier.evict(CHECKPOINTS, "a") == []  # nothing is confirmed: nothing is evicted
    assert all(local.exists(manifest_key("a", s)) for s in range(3))
    assert set(repo.replication_status("a").values()) <= {"local", "replicating"}
    remote.fail_puts = 0
    assert repo.wait_replicated(30)
    until(lambda: not local.exists(manifest_key("a", 1)), what="eviction")
    assert repo.replication_status("a") == {0: "remote", 1: "remote", 2: "replicated"}
    assert repo.steps("a") == [0, 1, 2]
    assert_same_state(repo.load("a", 0), make_state(0))  # from the remote
    assert repo.verify().checkpoints == 3
    remote.fail_puts = 10**9  # answered locally (tier/replicated/…): a save never asks the remote
    with pytest.raises(luopan.CheckpointExistsError):
        repo.save("a", 0, make_state(0))
    remote.fail_puts = 0
    repo.close()


def test_eviction_never_drops_pins_or_newest(tmp_path):
    repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"), **SMALL)
    for step in range(4):
        repo.save("a", step, make_state(step))
    repo.run("a").pin(1, "keep")
    assert repo.wait_replicated(30)
    assert repo.tier.evict(CHECKPOINTS, "a", KeepLast(1)) == [0, 2]
    assert repo.replication_status("a") == {0: "remote", 1: "replicated", 2: "remote", 3: "replicated"}
    repo.close()


def test_close_does_not_block_and_next_open_resumes(tmp_path, monkeypatch):
    remote = Wrapped(LocalStore(tmp_path / "remote"))
    remote.hold = threading.Event()
    monkeypatch.setattr(tier_mod, "CLOSE_TIMEOUT", 0.5)
    repo = luopan.open(tmp_path / "local", replicate_to=remote, **SMALL)
    repo.save("a", 0, make_state(0))
    until(remote.holding.is_set, what="an upload in progress")
    closing = threading.Thread(target=repo.close)  # the upload is held until hold.set(): a close that waited
    closing.start()                                # for it would never return (60 s only guards against a hang)
    closing.join(60)
    assert not closing.is_alive() and not remote.hold.is_set()
    assert LocalStore(tmp_path / "local").exists(pending_key("a", 0))
    remote.hold.set()
    with luopan.open(tmp_path / "local", replicate_to=remote.inner) as again:
        assert again.wait_replicated(30)
        assert again.replication_status("a") == {0: "replicated"}
        assert not LocalStore(tmp_path / "local").exists(pending_key("a", 0))


def test_overwrite_is_replicated_again(tmp_path):
    remote = tmp_path / "remote"
    with luopan.open(tmp_path / "local", replicate_to=str(remote), **SMALL) as repo:
        repo.save("a", 0, make_state(0))
        assert repo.wait_replicated(30)
        repo.save("a", 0, make_state(9), overwrite=True)
        assert repo.wait_replicated(30)
        assert repo.replication_status("a") == {0: "replicated"}
    assert_same_state(luopan.open(remote, create=False).load("a", 0), make_state(9))


def test_prune_of_tiered_repo_removes_both_copies(tmp_path):
    remote = tmp_path / "remote"
    with luopan.open(tmp_path / "local", replicate_to=str(remote), **SMALL) as repo:
        for step in range(3):
            repo.save("a", step, make_state(step))
        assert repo.wait_replicated(30)
        repo.prune("a", KeepLast(1))
        assert repo.steps("a") == [2]
    assert luopan.open(remote, create=False).steps("a") == [2]


def test_recorded_remote_is_used_by_later_opens_and_cli(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with luopan.open(local, replicate_to=str(remote), local_retention=KeepLast(1), **SMALL) as repo:
        for step in range(2):
            repo.save("a", step, make_state(step))
        assert repo.wait_replicated(30)
        until(lambda: repo.replication_status("a")[0] == "remote", what="eviction")
    plain = luopan.open(local)  # no replicate_to: tier/config.json names the remote
    assert plain.tier is not None and plain.tier.url == str(remote)
    assert_same_state(plain.load("a", 0), make_state(0))
    plain.close()
    res = CliRunner().invoke(app, ["ls", "-r", str(local), "a"])
    assert res.exit_code == 0, res.output
    assert "tier" in res.output and "remote" in res.output and "replicated" in res.output
    res = CliRunner().invoke(app, ["ls", "-r", str(local), "a", "--json"])
    assert '"tier": "remote"' in res.output


def test_cli_replicate_command(tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with luopan.open(local, **SMALL) as repo:  # saved before tiering
        repo.save("a", 0, make_state(0))
    res = CliRunner().invoke(app, ["replicate", "-r", str(local), "--to", str(remote), "--keep-local", "1"])
    assert res.exit_code == 0, res.output
    assert luopan.open(remote, create=False).steps("a") == [0]
    assert luopan.open(local, replicate=False).replication_status("a") == {0: "replicated"}


def test_cold_policy_moves_old_unpinned_checkpoints(tmp_path):
    local, remote, cold = tmp_path / "local", tmp_path / "remote", tmp_path / "cold"
    repo = luopan.open(local, replicate_to=str(remote), cold=ColdPolicy(str(cold), older_than="7d"), **SMALL)
    for step in range(3):
        repo.save("a", step, make_state(step))
    repo.run("a").pin(0)
    assert repo.wait_replicated(30)
    assert repo.apply_cold_policy() == []  # nothing is a week old yet
    later = datetime.now(timezone.utc) + timedelta(days=8)
    assert repo.apply_cold_policy(later, dry_run=True) == [("a", 1), ("a", 2)]
    assert repo.replication_status("a") == {0: "replicated", 1: "replicated", 2: "replicated"}
    assert repo.apply_cold_policy(later) == [("a", 1), ("a", 2)]
    assert repo.replication_status("a") == {0: "replicated", 1: "cold", 2: "cold"}
    assert not LocalStore(remote).exists(manifest_key("a", 1))
    assert_same_state(repo.load("a", 1), make_state(1))  # falls back to the cold store
    assert luopan.open(cold, create=False).verify().checkpoints == 2
    repo.close()
    res = CliRunner().invoke(app, ["cold", "-r", str(local), "--dry-run"])  # policy recorded in tier/config.json
    assert res.exit_code == 0, res.output


def test_bad_input(tmp_path):
    local = tmp_path / "local"
    with pytest.raises(InvalidNameError, match="scheme"):
        luopan.open(local, replicate_to="ftp://host/x")
    with pytest.raises(ConfigConflictError, match="itself"):
        luopan.open(local, replicate_to=str(local))
    with pytest.raises(ConfigConflictError, match="itself or inside"):
        luopan.open(local, replicate_to=str(local / "sub"))
    with pytest.raises(ConfigConflictError, match="needs replicate_to"):
        luopan.open(local, local_retention=KeepLast(1))
    with pytest.raises(ValueError, match="duration"):
        luopan.open(local, cold=ColdPolicy(str(tmp_path / "c"), older_than="soon"))
    other = luopan.open(tmp_path / "other")
    luopan.open(local).close()  # an existing repository: a new local tier would adopt the remote's (a node joining)
    with pytest.raises(ConfigConflictError, match="another luopan repository"):
        luopan.open(local, replicate_to=str(tmp_path / "other"))
    other.close()
    luopan.open(local, replicate_to=str(tmp_path / "r1")).close()
    with pytest.raises(ConfigConflictError, match="replicates to"):
        luopan.open(local, replicate_to=str(tmp_path / "r2"))
    with pytest.raises(LuopanError, match="not a tiered"):
        luopan.open(tmp_path / "plain").replication_status("a")


# -- S3 -----------------------------------------------------------------------------------------------------------
def test_s3_replication_eviction_and_fallback(s3_endpoint, tmp_path):
    url = fresh_url()
    repo = luopan.open(tmp_path / "local", replicate_to=url, local_retention=KeepLast(1), **SMALL)
    for step in range(3):
        repo.save("a", step, make_state(step))
    assert repo.wait_replicated(60)
    until(lambda: repo.replication_status("a") == {0: "remote", 1: "remote", 2: "replicated"}, what="eviction")
    assert_same_state(repo.load("a", 0), make_state(0))  # read from S3
    repo.close()
    alone = luopan.open(url, create=False)
    assert alone.steps("a") == [0, 1, 2] and alone.verify().checkpoints == 3
    assert_same_state(alone.load("a", 2), make_state(2))


KILL_CHILD = """
import luopan
repo = luopan.open({local!r}, replicate_to={url!r}, chunk_size=64 * 1024, pack_size=256 * 1024)
repo.save("a", 0, make_state(0))
repo.wait_replicated(60)
print("NOT KILLED")
"""


def test_kill_mid_replication_resumes_without_resending(s3_endpoint, tmp_path, child_env):
    url, local = fresh_url(), str(tmp_path / "local")
    env = {**child_env, "LUOPAN_CRASH_AT": "tier.pack.landed"}
    src = STATE_SRC + KILL_CHILD.format(local=local, url=url)
    proc = subprocess.run([PYTHON, "-c", src], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 97, proc.stdout + proc.stderr  # exited at the crash point after the first pack
    s3 = FsspecStore(url)
    landed = [k for k in s3.list("packs/")]
    assert len(landed) == 1 and not s3.exists(manifest_key("a", 0))
    needed = luopan.open(local, replicate=False).manifest("a", 0).packs
    assert len(needed) > 1
    assert LocalStore(local).exists(pending_key("a", 0))

    remote = Wrapped(FsspecStore(url))
    repo = luopan.open(local, replicate_to=remote, replicate=False)
    assert repo.replication_status("a") == {0: "local"}
    repo.tier.start()
    assert repo.wait_replicated(60)
    sent = [k for k in remote.puts if k.startswith("packs/")]
    assert landed[0] not in sent  # what already landed is not sent again
    assert sorted(sent + landed) == sorted(pack_key(p) for p in needed)
    assert repo.replication_status("a") == {0: "replicated"}
    assert LocalStore(local).exists(replicated_key("a", 0))
    repo.close()
    assert_same_state(luopan.open(url, create=False).load("a", 0), make_state(0))


def test_gc_of_a_tiered_repository_frees_the_local_copies_of_evicted_checkpoints(tmp_path):
    """gc collects the local tier only: after eviction the evicted checkpoints' local packs go, the remote keeps
    everything, and loads of evicted checkpoints still come from the remote."""
    remote_dir = tmp_path / "remote"
    repo = luopan.open(tmp_path / "local", replicate_to=str(remote_dir), local_retention=KeepLast(1), **SMALL)
    for step in range(4):
        repo.save("a", step, make_state(step))
    assert repo.wait_replicated(60)
    until(lambda: set(repo.replication_status("a").values()) == {"remote", "replicated"}, what="eviction")
    local = LocalStore(tmp_path / "local")
    remote = LocalStore(remote_dir)
    local_bytes = sum(local.size(k) for k in local.list("packs/"))
    remote_packs = set(remote.list("packs/"))
    rep = repo.gc(grace=0)
    assert rep.manifests == 1 and rep.deleted_packs > 0  # marked from the one local manifest
    newest = parse_manifest(local.get(manifest_key("a", 3)), "m")
    assert set(local.list("packs/")) == {pack_key(p) for p in newest.packs}
    assert sum(local.size(k) for k in local.list("packs/")) < local_bytes / 2
    assert set(remote.list("packs/")) == remote_packs  # the remote is not touched
    for step in range(4):
        assert_same_state(repo.load("a", step), make_state(step))
    assert repo.verify().checkpoints == 4
    repo.save("a", 4, make_state(4))  # saving after gc still works (fresh chunk locations)
    assert repo.wait_replicated(60)
    assert luopan.open(remote_dir, create=False).verify().checkpoints == 5
    repo.close()


def test_cli_tier_commands_refuse_bad_values_as_usage_errors(tmp_path):
    repo = luopan.open(tmp_path / "local")
    repo.save("a", 1, make_state(1))
    repo.close()
    runner = CliRunner()
    r = runner.invoke(app, ["replicate", "-r", str(tmp_path / "local"), "--to", str(tmp_path / "remote"),
                            "--keep-local", "abc"])
    assert r.exit_code == 2 and "--keep-local" in r.output
    r = runner.invoke(app, ["cold", "-r", str(tmp_path / "local"), "--to", str(tmp_path / "cold"),
                            "--older-than", "soon"])
    assert r.exit_code == 2 and "--older-than" in r.output
    assert not (tmp_path / "remote").exists() and not (tmp_path / "cold").exists()  # nothing created


def test_replication_goes_on_after_gc_replaced_the_index_files(tmp_path):
    """gc consolidates index files; the replicator must not keep asking for the old ones (it stalled for good)."""
    r = luopan.open(tmp_path / "l", replicate_to=str(tmp_path / "rem"), replicate=False)
    r.save("a", 1, {"w": np.zeros(50_000, "f4")})
    r.save("a", 2, {"w": np.ones(50_000, "f4")})
    assert r.tier.replicate(CHECKPOINTS, "a", 1)  # reads (and remembers) both index files
    r.gc(grace=0)  # replaces them by one
    assert r.tier.replicate(CHECKPOINTS, "a", 2)
    r.tier.start()
    assert r.wait_replicated(20)
    assert r.replication_status("a") == {1: "replicated", 2: "replicated"}
    r.close()
    assert luopan.open(tmp_path / "rem", create=False).verify().checkpoints == 2


def pause_manifest_commits(monkeypatch, first_only: bool = False):
    """Make the replicator stop just before it commits a manifest on the remote (after packs, index files, record
    and pin): it sets the first event and waits (bounded) for the second. Returns (in_commit, go)."""
    in_commit, go = threading.Event(), threading.Event()
    real = tier_mod.copy_manifest
    calls = {"n": 0}

    def slow_copy(*a, commit=None, **kw):
        calls["n"] += 1
        if first_only and calls["n"] > 1:
            return real(*a, commit=commit, **kw)

        def paused(fn):
            in_commit.set()
            go.wait(10)
            commit(fn)

        return real(*a, commit=paused, **kw)

    monkeypatch.setattr(tier_mod, "copy_manifest", slow_copy)
    return in_commit, go


def test_overwrite_while_the_step_is_being_copied_is_copied_again(tmp_path, monkeypatch):
    """An overwrite=True save of a step the replicator is copying: the remote ends with the new manifest, and
    eviction never drops the local copy on the strength of the old one."""
    in_commit, go = pause_manifest_commits(monkeypatch, first_only=True)
    r = luopan.open(tmp_path / "repo", replicate_to=str(tmp_path / "remote"))
    r.save("a", 1, {"x": np.zeros(1000)})
    assert in_commit.wait(10)  # the replicator read version 1 and is about to commit it on the remote
    r.save("a", 1, {"x": np.ones(1000)}, overwrite=True)
    go.set()
    assert r.wait_replicated(20)
    assert r.replication_status("a") == {1: "replicated"}
    assert luopan.open(tmp_path / "remote").load("a", 1)["x"][0] == 1.0
    r.save("a", 2, {"x": np.full(1000, 2.0)})
    assert r.wait_replicated(20)
    assert r.tier.evict(CHECKPOINTS, "a", KeepLast(1)) == [1]
    assert r.load("a", 1)["x"][0] == 1.0  # from the remote, the overwritten version
    r.close()


def test_a_pin_added_after_replication_reaches_the_remote(tmp_path):
    repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"), **SMALL)
    repo.save("a", 1, make_state(1))
    assert repo.wait_replicated(30)
    repo.run("a").pin(1, "release")
    remote = luopan.open(tmp_path / "remote", create=False)
    assert remote.run("a").pins()[1]["tag"] == "release"
    assert repo.run("a").unpin(1)
    assert remote.run("a").pins() == {}  # a delete reaches every tier
    repo.close()


def test_a_replicated_marker_confirms_only_the_manifest_it_names(tmp_path):
    """A local manifest replaced behind the replicator's back (the window between its last check and its marker,
    made wide here by writing the new version straight into the local tier, with no notification) leaves a marker
    naming the old manifest: the step is not counted as replicated, is not evicted, and is queued again on the
    next open."""
    repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"), **SMALL)
    for step in (1, 2):
        repo.save("a", step, make_state(step))
    assert repo.wait_replicated(30)
    scratch = luopan.open(tmp_path / "scratch", **SMALL)
    scratch.save("a", 1, make_state(7))
    for key in scratch.store.list("packs/"):
        repo.tier.local.put(key, scratch.store.get(key))
    repo.tier.local.put(manifest_key("a", 1), scratch.store.get(manifest_key("a", 1)))
    assert repo.replication_status("a")[1] == "local"
    assert repo.tier.evict(CHECKPOINTS, "a", KeepLast(1)) == []
    assert (CHECKPOINTS, "a", 1) in repo.tier._unreplicated()
    repo.close()
    again = luopan.open(tmp_path / "local")  # the next open queues it: the remote gets the new version
    assert again.wait_replicated(30)
    assert_same_state(luopan.open(tmp_path / "remote", create=False).load("a", 1), make_state(7))
    assert again.tier.evict(CHECKPOINTS, "a", KeepLast(1)) == [1]
    assert_same_state(again.load("a", 1), make_state(7))
    again.close()


def test_index_files_gc_removed_are_forgotten_and_skipped(tmp_path):
    src = luopan.open(tmp_path / "l")
    src.save("a", 1, {"w": np.zeros(50_000, "f4")})
    indexes = replication.IndexMap()
    packs = set(src.manifest("a", 1).packs)
    first = indexes.lookup(src.store, packs)
    assert first and all(src.store.exists(k) for k in first)
    src.save("a", 2, {"w": np.ones(50_000, "f4")})
    src.gc(grace=0)  # one new index file replaces both
    now = indexes.lookup(src.store, set(src.manifest("a", 2).packs))
    assert now and all(src.store.exists(k) for k in now) and not set(first) & set(now)

    class Stale:  # an index map that still names a file gc deleted: the copy goes on without it
        def lookup(self, store, wanted):
            return {next(iter(first)): set(wanted)}

    dst = LocalStore(tmp_path / "dst")
    replication.ensure_repository(src.store, dst)
    assert replication.copy_manifest(src.store, dst, CHECKPOINTS, "a", 2, indexes=Stale()) is not None
    assert luopan.open(tmp_path / "dst", create=False).verify().checkpoints == 1


def test_a_pin_added_while_the_manifest_is_being_committed_reaches_the_remote(tmp_path, monkeypatch):
    in_commit, go = pause_manifest_commits(monkeypatch)
    repo = luopan.open(tmp_path / "local", replicate_to=str(tmp_path / "remote"), **SMALL)
    repo.save("a", 1, make_state(1))
    assert in_commit.wait(10)  # the pin was looked for already; the manifest is not on the remote yet
    repo.run("a").pin(1, "release")
    go.set()
    assert repo.wait_replicated(30)
    assert luopan.open(tmp_path / "remote", create=False).run("a").pins()[1]["tag"] == "release"
    repo.close()


def test_storage_options_serve_a_recorded_remote(s3_endpoint, tmp_path, monkeypatch):
    url = fresh_url()
    luopan.open(tmp_path / "local", replicate_to=url, replicate=False).close()  # records the remote
    monkeypatch.delenv("LUOPAN_S3_ENDPOINT_URL")
    repo = luopan.open(tmp_path / "local", storage_options={"endpoint_url": s3_endpoint})
    repo.save("a", 1, make_state(1))
    assert repo.wait_replicated(30)
    repo.close()

"""The object-store backend against a real S3-protocol server: moto's standalone server on 127.0.0.1
(tests/s3server.py), not a mocked client."""

from __future__ import annotations

import sys
import uuid

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import luopan
from luopan.errors import InvalidNameError, LuopanError
from luopan.store import FsspecStore, KeyNotFound, open_store
from luopan.store.fsspec_store import MissingDependencyError, ObjectStoreError

from .s3server import BUCKET, fresh_url, s3_endpoint  # noqa: F401  (s3_endpoint is a fixture)
from .store_suite import StoreSuite


class TestS3Store(StoreSuite):
    @pytest.fixture(autouse=True)
    def _server(self, s3_endpoint):
        self.endpoint = s3_endpoint

    def make_store(self, tmp_path):
        return FsspecStore(fresh_url())

    def test_matches_dict_model(self, tmp_path, monkeypatch):
        """The suite's stateful test with fewer examples: every step here is several HTTP round trips."""
        import hypothesis

        from . import store_suite

        monkeypatch.setattr(store_suite, "settings", lambda **kw: hypothesis.settings(**{**kw, "max_examples": 10}))
        super().test_matches_dict_model(tmp_path)

    def test_describe_and_no_temporaries(self, store):
        assert store.describe().startswith(f"s3://{BUCKET}/")
        store.put("a/b", b"x")
        assert store.cleanup_temporaries() == 0

    def test_list_is_relative_recursive_and_skips_placeholders(self, store):
        store.put("runs/r/ckpt/00000001.json", b"m")
        store.put("packs/ab/x.pack", b"p")
        raw = store._fs
        raw.pipe_file(f"{store.prefix}/runs/r/ckpt/", b"")  # a "directory" marker some tools create
        raw.pipe_file(f"{store.prefix}/runs/r/ckpt/00000002.json.tmp-host-1-ab", b"t")  # copied-up temporary
        assert sorted(store.list("")) == ["packs/ab/x.pack", "runs/r/ckpt/00000001.json"]
        assert list(store.list("runs/r/ckpt/")) == ["runs/r/ckpt/00000001.json"]
        assert not store.exists("runs/r/ckpt") and not store.exists("runs")  # prefixes are not objects
        with pytest.raises(KeyNotFound):
            store.size("runs")

    def test_prefixes_are_isolated(self, s3_endpoint):
        a, b = FsspecStore(fresh_url()), FsspecStore(fresh_url())
        a.put("k", b"1")
        assert list(b.list("")) == [] and not b.exists("k")

    def test_conditional_create_is_done_by_the_server(self, store, monkeypatch):
        """Even when the existence check misses a concurrent writer, the server refuses the second create."""
        store.put("once", b"first")
        monkeypatch.setattr(store, "exists", lambda key: False)
        assert store.put_if_absent("once", b"second") is False
        assert store.get("once") == b"first"

    def test_falls_back_to_check_then_put_without_conditional_writes(self, store, monkeypatch):
        """A server that answers 501 to If-None-Match: the store switches to check-then-put and still works."""
        import errno

        real = store._fs.pipe_file
        calls = []

        def no_conditional(path, value, mode="overwrite", **kw):
            calls.append(mode)
            if mode == "create":
                raise OSError(errno.ENOSYS, "NotImplemented: A header you provided implies functionality that is "
                                            "not implemented")
            return real(path, value, **kw)

        monkeypatch.setattr(store._fs, "pipe_file", no_conditional)
        assert store.put_if_absent("k", b"1") is True
        assert store.put_if_absent("k", b"2") is False
        assert store.put_if_absent("k2", b"3") is True
        assert calls == ["create", "overwrite", "overwrite"] and store.get("k") == b"1"

    def test_signature_changes_when_the_object_is_replaced(self, store):
        store.put("s", b"one")
        sig = store.signature("s")
        assert sig is not None and sig[0] == 3 and store.signature("s") == sig
        store.put("s", b"two")
        assert store.signature("s") != sig
        with pytest.raises(KeyNotFound):
            store.signature("missing")

    @pytest.mark.parametrize("bad", ["/abs", "a/../b", "a\\b", "nul\0", "", "a//b", "dir/"])
    def test_rejects_unsafe_keys(self, store, bad):
        with pytest.raises(ValueError):
            store.put(bad, b"x")


# -- open_store and errors ----------------------------------------------------------------------------------------
def test_open_store_picks_fsspec_for_s3(s3_endpoint):
    s = open_store(f"s3://{BUCKET}/some/prefix/")
    assert isinstance(s, FsspecStore) and s.describe() == f"s3://{BUCKET}/some/prefix"


def test_repository_at_a_bucket_root(s3_endpoint):
    import s3fs

    s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir("luopan-root")
    with luopan.open("s3://luopan-root") as repo:
        repo.save("r", 1, {"x": np.arange(5)})
    assert sorted(k.split("/")[0] for k in FsspecStore("s3://luopan-root/").list("")) == \
        ["index", "luopan.json", "packs", "refs", "runs", "runs"]
    np.testing.assert_array_equal(luopan.open("s3://luopan-root", create=False).load("r")["x"], np.arange(5))


def test_unknown_scheme_is_our_error():
    with pytest.raises(InvalidNameError, match=r"unsupported repository URL scheme 'gopher'.*s3://"):
        luopan.open("gopher://host/repo")


def test_missing_optional_dependency_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    with pytest.raises(MissingDependencyError, match=r'pip install "luopan\[s3\]"') as info:
        open_store(f"s3://{BUCKET}/x")
    assert isinstance(info.value, LuopanError) and isinstance(info.value, ImportError)


def test_missing_bucket_names_the_url(s3_endpoint):
    with pytest.raises(ObjectStoreError, match=r"s3://no-such-bucket-here/x") as info:
        luopan.open("s3://no-such-bucket-here/x")
    assert isinstance(info.value, OSError)


def test_unreachable_endpoint_is_an_oserror_naming_the_url(s3_endpoint, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = FsspecStore("s3://b/p", endpoint_url=f"http://127.0.0.1:{port}", key="test", secret="test",
                    config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    monkeypatch.setattr(s._fs, "retries", 1, raising=False)
    with pytest.raises(OSError, match=r"s3://b/p"):
        s.get("luopan.json")


def test_aws_endpoint_url_is_honoured(s3_endpoint, monkeypatch):
    monkeypatch.delenv("LUOPAN_S3_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s = FsspecStore(fresh_url())
    s.put("k", b"v")
    assert s.get("k") == b"v"


# -- end to end ---------------------------------------------------------------------------------------------------
def test_save_load_verify_end_to_end(s3_endpoint):
    url = fresh_url()
    repo = luopan.open(url, chunk_size=64 * 1024)
    w = torch.randn(256, 128)
    state = {"model": {"w": w, "b": torch.arange(7, dtype=torch.int64)}, "np": np.linspace(0, 1, 1000),
             "step": 3, "name": "s3"}
    info = repo.save("run-a", 1, state, metrics={"loss": 0.5})
    assert info.stored_bytes > 0
    w[0] += 1
    info2 = repo.save("run-a", 2, state)
    assert info2.new_bytes <= 64 * 1024  # one changed row -> one chunk written
    repo.close()

    again = luopan.open(url, create=False)
    assert [c.step for c in again.checkpoints("run-a")] == [1, 2]
    out = again.load("run-a")
    assert torch.equal(out["model"]["w"], w) and torch.equal(out["model"]["b"], torch.arange(7))
    np.testing.assert_array_equal(out["np"], np.linspace(0, 1, 1000))
    assert out["step"] == 3 and out["name"] == "s3"
    first = again.load("run-a", step=1)
    assert not torch.equal(first["model"]["w"], w)
    again.verify("run-a")
    again.close()


def test_row_delta_on_s3(s3_endpoint):
    url = fresh_url()
    repo = luopan.open(url, chunk_size=16 * 1024, delta_policy=luopan.DeltaPolicy(min_bytes=1))
    emb = np.random.default_rng(0).standard_normal((1000, 64), dtype=np.float32)
    saved = {}
    for step in range(4):
        if step:
            emb[[3 * step, 500 + step, 990 - step]] += 1
        repo.save("emb", step, {"emb": emb})
        saved[step] = emb.copy()
    kinds = ["delta" in repo.manifest("emb", s).entry("emb") for s in range(4)]
    assert kinds[-1] and kinds[0] is False  # the last saves are row deltas
    repo.close()
    again = luopan.open(url, create=False)
    for step, value in saved.items():
        np.testing.assert_array_equal(again.load("emb", step=step)["emb"], value)
    again.verify("emb")


def test_cli_ls_on_s3(s3_endpoint):
    from luopan.cli.main import app

    url = fresh_url()
    with luopan.open(url) as repo:
        repo.save("run-a", 5, {"x": np.ones(4)}, metrics={"loss": 1.0})
    r = CliRunner().invoke(app, ["ls", "-r", url], catch_exceptions=False)
    assert r.exit_code == 0 and "run-a" in r.output
    r = CliRunner().invoke(app, ["verify", "-r", url], catch_exceptions=False)
    assert r.exit_code == 0


def test_only_committed_manifests_are_checkpoints(s3_endpoint, monkeypatch):
    url = fresh_url()
    repo = luopan.open(url)
    repo.save("run", 1, {"x": np.arange(100)})
    store = repo.store

    # A save that dies before its manifest is written: packs (and index) are there, the checkpoint is not.
    real = type(store).put_if_absent

    def no_manifest(self, key, data):
        if "/ckpt/" in key:
            raise ObjectStoreError(5, f"put {key} in {url} failed: connection reset")
        return real(self, key, data)

    monkeypatch.setattr(type(store), "put_if_absent", no_manifest)
    with pytest.raises(OSError):
        repo.save("run", 2, {"x": np.arange(100, 300)})
    monkeypatch.undo()
    repo.close()

    # Stray objects a reader must ignore: a temporary copied up from a filesystem and a directory marker.
    store._fs.pipe_file(f"{store.prefix}/runs/run/ckpt/00000003.json.tmp-host-1-ab", b"partial")
    store._fs.pipe_file(f"{store.prefix}/runs/run/ckpt/", b"")
    again = luopan.open(url, create=False)
    assert [c.step for c in again.checkpoints("run")] == [1]
    np.testing.assert_array_equal(again.load("run")["x"], np.arange(100))
    again.verify("run")


class TestFsspecGenericStore(StoreSuite):
    """The backend-neutral path (fs.info, check-then-put) on fsspec's in-memory filesystem: no server needed."""

    def make_store(self, tmp_path):
        return FsspecStore(f"memory://bucket/{uuid.uuid4().hex[:12]}")


def test_pin_and_prune_on_s3(s3_endpoint):
    from luopan.retention import KeepLast

    url = fresh_url()
    repo = luopan.open(url)
    for s in range(1, 6):
        repo.save("run", s, {"x": np.full(8, s, np.float32)})
    repo.run("run").pin(2, tag="keep")
    assert repo.prune("run", KeepLast(1), dry_run=True).remove == [1, 3, 4]
    assert repo.steps("run") == [1, 2, 3, 4, 5]
    repo.prune("run", KeepLast(1))
    again = luopan.open(url)
    assert again.steps("run") == [2, 5]
    assert again.verify("run").ok and again.load("run")["x"][0] == 5


def test_prune_and_gc_end_to_end_with_the_cli_on_s3(s3_endpoint):
    """`-r s3://…` for save (API), prune, gc, locks and verify: the freed packs are gone from the bucket and every
    retained checkpoint still verifies."""
    from luopan.cli.main import app

    url = fresh_url()
    repo = luopan.open(url, chunk_size=64 << 10, pack_size=256 << 10)
    rng = np.random.default_rng(3)
    states = {s: {"w": rng.standard_normal(50_000).astype(np.float32)} for s in range(6)}
    for s, st in states.items():
        repo.save("run", s, st)
    packs_before = set(repo.store.list("packs/"))
    runner = CliRunner()
    r = runner.invoke(app, ["prune", "run", "-r", url, "--keep-last", "2"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["gc", "-r", url, "--grace", "0"])
    assert r.exit_code == 0, r.output
    assert "delete 4 pack(s)" in r.output
    again = luopan.open(url)
    assert again.steps("run") == [4, 5]
    packs_after = set(again.store.list("packs/"))
    assert packs_after < packs_before
    assert packs_after == {f"packs/{p[:2]}/{p}.pack" for s in (4, 5) for p in again.manifest("run", s).packs}
    assert runner.invoke(app, ["verify", "-r", url]).exit_code == 0
    for s in (4, 5):
        np.testing.assert_array_equal(again.load("run", s)["w"], states[s]["w"])
    assert runner.invoke(app, ["locks", "-r", url]).output.strip() == "no locks"


def test_refuses_to_create_a_repository_in_a_non_empty_prefix(s3_endpoint):
    url = fresh_url()
    FsspecStore(url).put("data/other-tool.bin", b"not ours")
    with pytest.raises(luopan.NotARepositoryError, match="already holds objects"):
        luopan.open(url)
    assert list(FsspecStore(url).list("")) == ["data/other-tool.bin"]  # nothing written


def test_storage_options_reach_the_object_store(s3_endpoint, monkeypatch):
    """luopan.open(url, storage_options=…) configures the filesystem: here the endpoint, with the environment's
    endpoint variable removed (without the option the client would go to the real AWS endpoint)."""
    monkeypatch.delenv("LUOPAN_S3_ENDPOINT_URL")
    url = fresh_url()
    repo = luopan.open(url, storage_options={"endpoint_url": s3_endpoint, "skip_instance_cache": True})
    repo.save("run", 1, {"x": np.arange(5.0)})
    assert repo.store._fs.client_kwargs.get("endpoint_url", repo.store._fs.endpoint_url) == s3_endpoint
    monkeypatch.setenv("LUOPAN_S3_ENDPOINT_URL", s3_endpoint)
    np.testing.assert_array_equal(luopan.open(url).load("run")["x"], np.arange(5.0))
    with pytest.raises(InvalidNameError, match="object-store URLs only"):
        open_store("/tmp/some/dir", endpoint_url=s3_endpoint)

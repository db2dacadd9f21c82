"""Live weight sync through an object store (docs/format.md §19.4): a Publisher writes to ``s3://…`` on a real
S3-protocol server (moto's, on 127.0.0.1) and Subscribers read it with ranged GETs — every step bit-exact, a lagging
worker catching up with one read of a prefix, old objects deleted, a tampered object or a failed index PUT refused
or survived with the tensors untouched."""

from __future__ import annotations

import pytest

import luopan.sync
from luopan.errors import CorruptDownloadError, StorageError, UsageError
from luopan.store import open_store

from .s3server import fresh_url, s3_endpoint  # noqa: F401  (s3_endpoint is a fixture)
from .test_sync import bits, keys, make_model, train_step  # noqa: F401  (keys is a fixture)


def test_publish_to_an_object_store_and_follow_it(s3_endpoint, keys):
    key, trusted, _ = keys
    url = fresh_url()
    trainer, worker, late = make_model(0), make_model(1), make_model(2)
    pub = luopan.sync.Publisher(url, key=key, keep=4)
    sub = luopan.sync.Subscriber(url, trusted_keys=trusted)
    lag = luopan.sync.Subscriber(url, trusted_keys=trusted)
    for step in range(7):
        train_step(trainer, step)
        v = pub.publish(step, trainer)
        assert sub.update(worker) == v and bits(worker) == bits(trainer)
        if step == 0:
            assert lag.update(late) == 1
    pub.wait()
    # the late worker missed 6 versions (more than keep): the newest full version and one delta from it
    assert lag.update(late) == 7 and bits(late) == bits(trainer)
    store = open_store(url)
    index = luopan.sync.index.parse_index(store.get("index.json"))
    listed = {f.name for f in index.files()}
    names = set(store.list())
    assert "index.json" in names and {n for n in names if n.endswith(".lpsync")} >= listed
    assert len([n for n in names if n.startswith("deltas/")]) <= 2  # the last two publishes' files, no more
    # one step behind: a prefix of the newest delta object, not all of it
    train_step(trainer, 7)
    pub.publish(7, trainer)
    assert sub.update(worker) == 8 and bits(worker) == bits(trainer)
    newest = luopan.sync.index.parse_index(store.get("index.json"))
    one = next(d for d in newest.deltas if d.source == 7)
    assert sub.last_bytes == one.file.size < store.size(one.file.name)


def test_a_tampered_object_is_refused(s3_endpoint, keys):
    key, trusted, _ = keys
    url = fresh_url()
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(url, key=key, keep=3)
    sub = luopan.sync.Subscriber(url, trusted_keys=trusted)
    for step in range(2):
        train_step(trainer, step)
        pub.publish(step, trainer)
        sub.update(worker)
    train_step(trainer, 2)
    pub.publish(2, trainer)
    store = open_store(url)
    index = luopan.sync.index.parse_index(store.get("index.json"))
    name = index.delta_from(2).file.name
    data = bytearray(store.get(name))
    data[40] ^= 1
    store.put(name, bytes(data))
    before = bits(worker)
    with pytest.raises(CorruptDownloadError):
        sub.update(worker)
    assert bits(worker) == before and sub.version == 2


def test_a_failed_index_put_keeps_the_previous_version(s3_endpoint, keys, monkeypatch):
    key, trusted, _ = keys
    url = fresh_url()
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(url, key=key, keep=3)
    sub = luopan.sync.Subscriber(url, trusted_keys=trusted)
    train_step(trainer, 0)
    pub.publish(0, trainer)
    sub.update(worker)
    real = pub.target.store.put

    def put(k, data):
        if k == "index.json":
            raise OSError(5, "simulated: the connection dropped")
        return real(k, data)

    monkeypatch.setattr(pub.target.store, "put", put)
    train_step(trainer, 1)
    with pytest.raises(StorageError):
        pub.publish(1, trainer)
    monkeypatch.undo()
    assert sub.update(worker) is None and sub.version == 1  # the previous index, as it was
    assert pub.publish(1, trainer) == 2 and sub.update(worker) == 2 and bits(worker) == bits(trainer)


def test_bad_targets_are_refused(tmp_path):
    with pytest.raises(UsageError):
        luopan.sync.Publisher("ftp://host/x")
    with pytest.raises(UsageError):
        luopan.sync.Publisher(tmp_path / "d", storage_options={"key": "k"})
    with pytest.raises(UsageError):
        luopan.sync.Subscriber("ftp://host/x")

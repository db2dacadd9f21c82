"""Live weight sync (luopan.sync, docs/format.md §19): element deltas round-trip bit-exactly, a Subscriber keeps a
live model equal to the Publisher's after every step (one delta per update, a full version for a new or far-behind
worker), its fingerprint is luopan.torch.fingerprint's, and tampered, replayed, expired, unsigned, foreign-key and
wrong-base updates are refused before any tensor changes."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import luopan.sync
import luopan.sync.subscriber as subscriber_mod
from luopan.errors import (
    BaseMismatchError,
    ChannelExpiredError,
    ChannelRollbackError,
    CorruptChannelIndexError,
    CorruptDownloadError,
    LayoutMismatchError,
    SignatureError,
    UnsignedError,
    UntrustedKeyError,
)
from luopan.signing import TrustedKeys, generate_key, load_signing_key
from luopan.sync.delta import decode_bitmap, decode_gaps, decode_gaps16, encode_bitmap, encode_delta, encode_gaps, \
    gaps_size, parse_delta
from luopan.torch import fingerprint


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 50, bias=False))
    m[3].weight = m[0].weight.__class__(m[0].weight.detach().clone())  # untied here; tied in test_tied
    m = m.to(torch.bfloat16)
    m.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    m.register_buffer("scale", torch.ones(4, dtype=torch.float32))
    return m


def train_step(m: torch.nn.Module, step: int, frac: float = 0.05) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in m.parameters():
            mask = torch.rand(p.shape, generator=g) < frac
            p[mask] += (0.01 * torch.randn(p.shape, generator=g)).to(p.dtype)[mask]
        m.steps += 1
        if step % 3 == 0:
            m.scale.mul_(1.001)


def bits(m: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes() for k, v in m.state_dict().items()}


@pytest.fixture()
def keys(tmp_path):
    key_path, pub = generate_key(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(pub, trusted / "pub.pub")
    other, _ = generate_key(tmp_path / "other")
    return load_signing_key(key_path), TrustedKeys.load(trusted), load_signing_key(other)


# ---------------------------------------------------------------------------------------------------- encoding

@pytest.mark.parametrize("numel,density", [(1, 1.0), (10, 0.3), (1000, 0.01), (100_000, 0.001), (5000, 0.9),
                                           (3_000_000, 0.0001)])
def test_index_codings_round_trip(numel, density):
    rng = np.random.default_rng(numel)
    idx = np.flatnonzero(rng.random(numel) < density)
    if not idx.size:
        idx = np.array([numel - 1])
    gaps = encode_gaps(idx)
    assert gaps.size == gaps_size(idx)
    assert np.array_equal(decode_gaps(gaps, idx.size, numel), idx)
    assert np.array_equal(decode_bitmap(encode_bitmap(idx, numel), idx.size, numel), idx)


def test_gaps16_round_trip_and_refusals():
    """Fixed 16-bit gaps (from 64 elements, every gap below 2**16): what the publisher writes for element deltas."""
    rng = np.random.default_rng(7)
    idx = np.sort(rng.choice(1 << 20, 5000, replace=False))
    data = encode_delta(1, 2, "blake3:" + "0" * 64, [("w", "bfloat16", (1 << 20,), idx, np.zeros(10000, np.uint8))])
    header, layers = parse_delta(data)
    assert header.layers[0].tensors[0].mode == "gaps16" and header.layers[0].tensors[0].index_bytes == 10000
    assert np.array_equal(layers[0][1][0][1], idx)
    assert np.array_equal(decode_gaps16(np.frombuffer(np.diff(idx, prepend=0).astype("<u2").tobytes(), np.uint8),
                                        idx.size, 1 << 20), idx)
    for bad, count, numel in (([1, 0, 0, 0], 2, 10),  # a zero gap after the first: not ascending
                              ([5, 0, 5, 0], 2, 10),  # beyond numel
                              ([1, 0], 2, 10),  # too short
                              ([], 0, 10)):
        with pytest.raises(ValueError):
            decode_gaps16(np.array(bad, np.uint8), count, numel)
    far = np.array([0, 70_000] + list(range(70_001, 70_100)))  # a gap of 2**16 or more: varint gaps
    data = encode_delta(1, 2, "blake3:" + "0" * 64,
                        [("w", "bfloat16", (1 << 20,), far, np.zeros(far.size * 2, np.uint8))])
    assert parse_delta(data)[0].layers[0].tensors[0].mode == "gaps"


def test_big_gaps_use_long_varints():
    idx = np.array([0, 127, 128, 128 + 2**14, 2**40, 2**47 - 1], dtype=np.int64)
    assert np.array_equal(decode_gaps(encode_gaps(idx), idx.size, 2**47), idx)


@pytest.mark.parametrize("data,count,numel", [
    ([0x80], 1, 10),  # ends inside a varint
    ([1, 0], 2, 10),  # a zero gap: not ascending
    ([5, 5], 2, 10),  # beyond numel
    ([0x81, 0x00], 1, 1000),  # overlong
    ([1], 2, 10),  # too few
    ([0xFF] * 8 + [1], 1, 2**48),  # a 9-byte varint
])
def test_bad_gap_sections_are_refused(data, count, numel):
    with pytest.raises(ValueError):
        decode_gaps(np.array(data, np.uint8), count, numel)


def test_delta_file_chooses_the_smaller_coding():
    n = 1 << 16
    sparse, dense = np.array([5, 900]), np.arange(0, n, 3)
    data = encode_delta(1, 2, "blake3:" + "0" * 64, [
        ("a", "bfloat16", (n,), sparse, np.zeros(4, np.uint8)),
        ("b", "float32", (n,), dense, np.zeros(dense.size * 4, np.uint8)),
        ("c", "int64", (3,), None, np.zeros(24, np.uint8))])
    header, layers = parse_delta(data)
    assert len(header.layers) == len(layers) == 1 and layers[0][0].version == 2
    parts = layers[0][1]
    assert [t.mode for t in header.layers[0].tensors] == ["gaps", "bitmap", "whole"]
    assert np.array_equal(parts[0][1], sparse) and np.array_equal(parts[1][1], dense) and parts[2][1] is None


# ----------------------------------------------------------------------------------------------- sync in process

def test_subscriber_follows_every_step_bit_exactly(tmp_path, keys):
    key, trusted, _ = keys
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(tmp_path / "ch", key=key, keep=3)
    sub = luopan.sync.Subscriber(tmp_path / "ch", trusted_keys=trusted)
    assert sub.version is None
    for step in range(10):
        train_step(trainer, step)
        v = pub.publish(step, trainer)
        assert sub.update(worker) == v == sub.version
        assert bits(worker) == bits(trainer)
        assert sub.fingerprint == fingerprint(trainer) == fingerprint(worker)
        if step:
            assert 0 < sub.last_bytes < pub.last_bytes.get("full", 1 << 40)  # one delta, smaller than a full
        assert sub.update(worker) is None  # nothing new
    files = sorted(os.listdir(tmp_path / "ch" / "deltas"))
    assert all(f.endswith(".lpsync") for f in files) and len(files) <= 6  # last index's and the one before


def test_a_worker_that_missed_steps_catches_up_in_one_fetch(tmp_path):
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=5)
    sub = luopan.sync.Subscriber(tmp_path / "ch")
    train_step(trainer, 0)
    pub.publish(0, trainer)
    sub.update(worker)
    for step in range(1, 5):
        train_step(trainer, step)
        pub.publish(step, trainer)
    reads = []
    real = sub._get
    sub._get = lambda name, ref: reads.append(name) or real(name, ref)  # type: ignore[method-assign]
    assert sub.update(worker) == 5
    assert bits(worker) == bits(trainer)
    assert len(reads) == 2 and reads[1].startswith("deltas/00000001-00000005")  # the index, one delta
    # fallen further behind than keep: the newest full version and one delta from it
    for step in range(5, 13):
        train_step(trainer, step)
        pub.publish(step, trainer)
    reads.clear()
    assert sub.update(worker) == 13 and bits(worker) == bits(trainer)
    assert [r.split("/")[0] for r in reads] == ["index.json", "full", "deltas"]


def test_doubling_spacing_serves_every_lag_with_one_delta(tmp_path):
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=6, spacing="doubling")
    held = {}
    for step in range(14):
        train_step(trainer, step)
        held[pub.publish(step, trainer)] = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    index = luopan.sync.index.parse_index((tmp_path / "ch" / "index.json").read_bytes())
    assert sorted(14 - d.source for d in index.deltas) == [1, 2, 4, 6]  # 1, 2, 4 and keep back
    for lag in range(1, 7):
        worker = make_model(1)
        worker.load_state_dict(held[14 - lag])
        sub = luopan.sync.Subscriber(tmp_path / "ch")
        reads = []
        real = sub._get
        sub._get = lambda name, ref: reads.append(name) or real(name, ref)  # type: ignore[method-assign]
        assert sub.update(worker) == 14 and bits(worker) == bits(trainer)
        assert len(reads) == 2 and reads[1].startswith("deltas/"), (lag, reads)


@pytest.mark.parametrize("keep,full_every", [(8, 8), (5, 4)])
def test_doubling_spacing_serves_new_workers_at_every_version(tmp_path, keep, full_every):
    """The newest full version is at any distance from the newest version: a new worker still finds the delta
    from it (the publisher lists it; the subscriber applies a delta from at or before it)."""
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=keep, full_every=full_every, spacing="doubling")
    for step in range(21):
        train_step(trainer, step)
        v = pub.publish(step, trainer)
        worker = make_model(1)
        assert luopan.sync.Subscriber(tmp_path / "ch").update(worker) == v and bits(worker) == bits(trainer), v


def _changed_elements(a: dict[str, bytes], b: dict[str, bytes], model: torch.nn.Module) -> set[tuple[str, int]]:
    """(tensor, flat index) of the elements whose bits differ between two ``bits`` snapshots."""
    out = set()
    for k, t in model.state_dict().items():
        size = t.element_size()
        x = np.frombuffer(a[k], np.uint8).reshape(-1, size)
        y = np.frombuffer(b[k], np.uint8).reshape(-1, size)
        out |= {(k, int(i)) for i in np.flatnonzero((x != y).any(axis=1))}
    return out


def test_one_file_serves_every_lag_with_the_union_of_its_changes(tmp_path):
    """A publish writes one delta file, newest layer first: the delta from each kept version is a prefix of it, and
    the elements that prefix carries are the union of the changes since that version (at most twice it: a layer is
    re-encoded once half of it changed again)."""
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=6)
    snaps = {}
    for step in range(12):
        train_step(trainer, step, frac=0.2)  # dense enough that elements change again within the window
        snaps[pub.publish(step, trainer)] = bits(trainer)
    index = luopan.sync.index.parse_index((tmp_path / "ch" / "index.json").read_bytes())
    assert sorted(d.source for d in index.deltas) == list(range(6, 12))
    assert len({d.file.name for d in index.deltas}) == 1  # one file, a prefix of it per delta
    data = (tmp_path / "ch" / index.deltas[0].file.name).read_bytes()
    assert max(d.file.size for d in index.deltas) == len(data)  # the delta from the oldest: the whole file
    header, layers = parse_delta(data)
    assert [layer.version for layer, _parts in layers] == list(range(12, 6, -1))
    numels = {k: t.numel() for k, t in trainer.state_dict().items()}
    for d in index.deltas:
        prefix = data[:d.file.size]
        _h, held = parse_delta(prefix)
        assert [layer.version for layer, _p in held] == list(range(12, d.source, -1))
        carried, count = set(), 0
        for _layer, parts in held:
            for t, idx, _values in parts:
                items = range(numels[t.name]) if idx is None else idx.tolist()
                carried |= {(t.name, int(i)) for i in items}
                count += t.count
        union = set().union(*(_changed_elements(snaps[u - 1], snaps[u], trainer) for u in range(d.source + 1, 13)))
        whole = {t.name for _l, parts in held for t, idx, _v in parts if idx is None}
        assert union <= carried  # every element that changed since the worker's version is carried …
        assert {x for x in carried - union if x[0] not in whole} == set()  # … and (but whole tensors) only those
        by_element = sum(t.count for _l, parts in held for t, idx, _v in parts if idx is not None)
        assert by_element <= 2 * len(union), (d.source, by_element, len(union))


def test_a_later_layer_is_written_over_an_older_one(tmp_path, monkeypatch):
    """Layers are not re-encoded here: an element that changed in two versions is in both layers, with two values;
    a worker catching up over both applies them oldest first and ends bit-equal (the result's fingerprint is
    checked before anything is written)."""
    monkeypatch.setattr(luopan.sync.tensors.Published, "REENCODE", 0.0)
    trainer, worker = make_model(0), make_model(3)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=4)
    sub = luopan.sync.Subscriber(tmp_path / "ch")
    pub.publish(0, trainer)
    sub.update(worker)
    for step, value in ((1, 0.5), (2, -0.25), (3, 2.0)):
        with torch.no_grad():
            trainer[1].weight[3, 4] = value  # the same element, every version
            trainer[1].weight[step, 0] += 1
        pub.publish(step, trainer)
    data = max((tmp_path / "ch" / "deltas").iterdir(), key=lambda p: p.name[9:17]).read_bytes()
    _h, layers = parse_delta(data)
    flat = 3 * 16 + 4
    holding = [layer.version for layer, parts in layers for t, idx, _v in parts
               if t.name == "1.weight" and idx is not None and flat in idx.tolist()]
    assert holding == [4, 3, 2]  # stale copies in the older layers
    assert sub.update(worker) == 4 and bits(worker) == bits(trainer)


def _published(tmp_path, steps: int):
    """A trainer that published ``steps`` versions (keep 4), a fresh worker model and a Subscriber."""
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(tmp_path / "ch", keep=4)
    for step in range(steps):
        train_step(trainer, step)
        pub.publish(step, trainer)
    return trainer, worker, pub, luopan.sync.Subscriber(tmp_path / "ch")


def test_a_failed_publish_starts_over_from_a_full_version(tmp_path, monkeypatch):
    """The index cannot be placed (a disk error): publish raises a typed error, the previous index stays, and the
    next publish writes a full version (what the failed one took in is not trusted), which workers follow."""
    from luopan.errors import StorageError

    trainer, worker, pub, sub = _published(tmp_path, 3)
    sub.update(worker)
    train_step(trainer, 3)

    def fail(tmp, path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(luopan.sync.targets, "_place_index", fail)
    with pytest.raises(StorageError):
        pub.publish(3, trainer)
    monkeypatch.undo()
    assert sub.update(worker) is None and sub.version == 3  # the previous index, as it was
    assert not [n for d in ("", "full", "deltas") for n in os.listdir(tmp_path / "ch" / d) if ".tmp-" in n]
    train_step(trainer, 4)
    assert pub.publish(4, trainer) == 4 and "full" in pub.last_bytes
    assert sub.update(worker) == 4 and bits(worker) == bits(trainer)
    train_step(trainer, 5)
    pub.publish(5, trainer)
    assert sub.update(worker) == 5 and bits(worker) == bits(trainer) and sub.last_bytes < pub.last_bytes["deltas"] + 1


def test_fresh_subscriber_restart_and_state_file(tmp_path, keys):
    key, trusted, _ = keys
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch", key=key, keep=2)
    for step in range(5):
        train_step(trainer, step)
        pub.publish(step, trainer)
    old_index = (tmp_path / "ch" / "index.json").read_bytes()
    worker = make_model(3)
    state = tmp_path / "sub.state"
    sub = luopan.sync.Subscriber(tmp_path / "ch", trusted_keys=trusted, state_file=state)
    assert sub.update(worker) == 5 and bits(worker) == bits(trainer)
    train_step(trainer, 5)
    pub.publish(5, trainer)
    # a restarted subscriber on a model that still holds version 5: it finds the version by fingerprint
    sub2 = luopan.sync.Subscriber(tmp_path / "ch", trusted_keys=trusted, state_file=state)
    assert sub2.update(worker) == 6 and bits(worker) == bits(trainer) and sub2.last_bytes < 4000
    # and it remembers the newest index it saw: an old one served again is a replay
    (tmp_path / "ch" / "index.json").write_bytes(old_index)
    before = bits(worker)
    sub3 = luopan.sync.Subscriber(tmp_path / "ch", trusted_keys=trusted, state_file=state)
    with pytest.raises(ChannelRollbackError):
        sub3.update(worker)
    assert bits(worker) == before


def test_tied_weights_and_other_dtypes(tmp_path):
    def tied(seed):
        m = make_model(seed)
        m[3].weight = m[0].weight
        return m

    trainer, worker = tied(0), tied(1)
    pub = luopan.sync.Publisher(tmp_path / "ch")
    sub = luopan.sync.Subscriber(tmp_path / "ch")
    for step in range(4):
        train_step(trainer, step)
        pub.publish(step, trainer)
        sub.update(worker)
        assert bits(worker) == bits(trainer)
        assert worker[3].weight.data_ptr() == worker[0].weight.data_ptr()


def test_a_worker_that_ties_what_the_publisher_does_not_is_refused(tmp_path):
    trainer, worker = make_model(0), make_model(1)
    worker[3].weight = worker[0].weight  # tied in the worker only
    with torch.no_grad():
        trainer[3].weight.copy_(trainer[0].weight)  # equal values, separate memory in the publisher
    pub = luopan.sync.Publisher(tmp_path / "ch")
    sub = luopan.sync.Subscriber(tmp_path / "ch")
    pub.publish(0, trainer)
    assert sub.update(worker) == 1 and bits(worker) == bits(trainer)
    with torch.no_grad():
        trainer[0].weight[0, 0] += 1  # only one of the two changes
    pub.publish(1, trainer)
    before = bits(worker)
    with pytest.raises(LayoutMismatchError):
        sub.update(worker)
    assert bits(worker) == before


def test_staging_more_elements_than_a_tensor_holds_folds_them_into_one_copy():
    """Many layers of one tensor (a hostile file, or a long catch-up): staging keeps at most one copy of it."""
    from luopan.sync.delta import TensorDelta
    from luopan.sync.tensors import Stage
    from luopan.tree import flatten

    live = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    _s, leaves = flatten(live)
    stage = Stage(leaves)
    t = TensorDelta("w", "bfloat16", (1000,), "gaps16", 600, 1200, 1200)
    for k in range(3):  # 1,800 staged elements for a tensor of 1,000
        idx = np.arange(600) + 200 * k
        stage.add(t, idx, memoryview(np.full(600, k + 1, np.int16).tobytes()))
    assert "w" in stage.whole and "w" not in stage.elements
    want = np.zeros(1000, np.int16)
    for k in range(3):
        want[200 * k:200 * k + 600] = k + 1
    assert np.array_equal(stage.whole["w"], want)  # later layers over earlier ones, as when applied in order


def test_a_state_dict_of_live_tensors(tmp_path):
    state = {"w": torch.randn(300, 7), "h": torch.randn(64, dtype=torch.float16)}
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    pub, sub = luopan.sync.Publisher(tmp_path / "ch"), luopan.sync.Subscriber(tmp_path / "ch")
    for step in range(3):
        state["w"][step, :3] += 1
        pub.publish(step, state)
        sub.update(live)
        assert all(torch.equal(live[k], state[k]) for k in state)


# ------------------------------------------------------------------------------------------------ refusals

class Setup:
    def __init__(self, tmp_path, key, trusted, steps=3):
        self.root = tmp_path / "ch"
        self.trainer, self.worker = make_model(0), make_model(1)
        self.pub = luopan.sync.Publisher(self.root, key=key, keep=3)
        self.sub = luopan.sync.Subscriber(self.root, trusted_keys=trusted)
        for step in range(steps):
            self.step(step)
            assert self.sub.update(self.worker) is not None

    def step(self, step):
        train_step(self.trainer, step)
        return self.pub.publish(step, self.trainer)

    def refused(self, error, sub=None):
        before = bits(self.worker)
        with pytest.raises(error):
            (sub or self.sub).update(self.worker)
        assert bits(self.worker) == before


def _newest_delta(root) -> str:
    return str(root / "deltas" / max(os.listdir(root / "deltas"), key=lambda n: (n[9:17], n[:8])))


def test_tampered_delta_is_refused(tmp_path, keys):
    key, trusted, _ = keys
    s = Setup(tmp_path, key, trusted)
    s.step(3)
    path = _newest_delta(s.root)
    data = bytearray(open(path, "rb").read())
    header = luopan.sync.delta.parse_header(bytes(data))
    assert [layer.version for layer in header.layers] == [4, 3, 2]  # keep=3: down to the oldest base (1) + 1
    data[header.layers[0].end - 5] ^= 0x40  # inside the prefix the worker at version 3 reads
    open(path, "wb").write(bytes(data))
    s.refused(CorruptDownloadError)
    assert s.sub.version == 3


def test_tampered_index_is_refused(tmp_path, keys):
    key, trusted, _ = keys
    s = Setup(tmp_path, key, trusted)
    s.step(3)
    idx = s.root / "index.json"
    idx.write_bytes(idx.read_bytes().replace(b'"step":3', b'"step":4'))
    s.refused(SignatureError)
    idx.write_bytes(b"{" + idx.read_bytes())
    s.refused(CorruptChannelIndexError)


def test_replayed_index_is_refused(tmp_path, keys):
    key, trusted, _ = keys
    s = Setup(tmp_path, key, trusted)
    old = (s.root / "index.json").read_bytes()
    s.step(3)
    assert s.sub.update(s.worker) == 4
    (s.root / "index.json").write_bytes(old)
    s.refused(ChannelRollbackError)


def test_expired_index_is_refused(tmp_path, keys, monkeypatch):
    key, trusted, _ = keys
    s = Setup(tmp_path, key, trusted)
    s.step(3)
    real = subscriber_mod.time.time
    monkeypatch.setattr(subscriber_mod.time, "time", lambda: real() + 8 * 86400)
    s.refused(ChannelExpiredError)


def test_foreign_key_and_unsigned_indexes_are_refused(tmp_path, keys):
    key, trusted, other = keys
    s = Setup(tmp_path, key, trusted)
    foreign = luopan.sync.Publisher(tmp_path / "foreign", key=other)
    foreign.publish(9, s.trainer)
    s.refused(UntrustedKeyError, luopan.sync.Subscriber(tmp_path / "foreign", trusted_keys=trusted))
    unsigned = luopan.sync.Publisher(tmp_path / "unsigned")
    unsigned.publish(9, s.trainer)
    s.refused(UnsignedError, luopan.sync.Subscriber(tmp_path / "unsigned", trusted_keys=trusted))


def test_other_base_is_refused(tmp_path, keys):
    key, trusted, _ = keys
    s = Setup(tmp_path, key, trusted)
    s.step(3)
    with torch.no_grad():  # the worker's tensors changed behind the subscriber's back
        s.worker[1].bias[0] += 1
    s.refused(BaseMismatchError)
    with torch.no_grad():
        s.worker[1].bias[0] -= 1
    # a delta signed by the trusted key, listed from the version the worker holds, but made for other tensors
    other = Setup(tmp_path / "o", key, trusted, steps=0)
    train_step(other.trainer, 99)
    for step in range(4):
        other.step(step)
    shutil.rmtree(s.root)
    shutil.copytree(other.root, s.root)
    s.refused(BaseMismatchError)


def test_other_model_is_refused(tmp_path):
    trainer = make_model(0)
    pub = luopan.sync.Publisher(tmp_path / "ch")
    pub.publish(0, trainer)
    worker = torch.nn.Linear(3, 3)
    before = worker.weight.detach().clone()
    with pytest.raises(LayoutMismatchError):
        luopan.sync.Subscriber(tmp_path / "ch").update(worker)
    assert torch.equal(worker.weight, before)


def test_subscriber_over_http(tmp_path, keys, monkeypatch):
    """The target directory served as it is by a real nginx: the subscriber reads index and deltas over HTTP."""
    from .nginx import NGINX, Nginx

    if NGINX is None:
        pytest.skip("nginx is not installed (make setup installs it): the HTTP subscriber needs a web server")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"])))
    key, trusted, _ = keys
    site = tmp_path / "site"
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(site / "ch", key=key, keep=3)
    with Nginx(str(site)) as web:
        sub = luopan.sync.Subscriber(web.url + "/ch", trusted_keys=trusted)
        for step in range(5):
            train_step(trainer, step)
            v = pub.publish(step, trainer)
            assert sub.update(worker) == v and bits(worker) == bits(trainer)
        log = web.requests(at_least=9)
        paths = [r[0] for r in log]
        assert paths.count("/ch/index.json") == 5 and sum(p.startswith("/ch/deltas/") for p in paths) == 4
        # each delta is a range of its file (its newest layers): 206 Partial Content, and once the file holds
        # older layers than the worker needs, fewer bytes than the file
        deltas = [r for r in log if r[0].startswith("/ch/deltas/")]
        assert all(status == 206 and rng.startswith("bytes=0-") for _p, status, _n, rng in deltas), deltas
        assert deltas[-1][2] < os.path.getsize(site / deltas[-1][0].lstrip("/"))
        train_step(trainer, 5)  # a damaged file on the server: refused, the model untouched
        pub.publish(5, trainer)
        path = _newest_delta(site / "ch")
        open(path, "r+b").write(b"\0" * 16)
        before = bits(worker)
        with pytest.raises(CorruptDownloadError):
            sub.update(worker)
        assert bits(worker) == before


def test_two_publishers_on_one_target_are_refused(tmp_path):
    from luopan.errors import UsageError

    trainer = make_model(0)
    a = luopan.sync.Publisher(tmp_path / "ch")
    a.publish(0, trainer)
    b = luopan.sync.Publisher(tmp_path / "ch")  # continues from the index: version 2 next
    assert b.publish(1, trainer) == 2
    with pytest.raises(UsageError, match="another Publisher"):
        a.publish(2, trainer)
    assert luopan.sync.Subscriber(tmp_path / "ch").update(make_model(1)) == 2


def test_a_publish_whose_index_was_placed_before_it_failed_is_adopted(tmp_path, monkeypatch):
    """The index was renamed into place, then the directory sync failed: subscribers see that version, and the
    Publisher goes on from it (with a full version) instead of refusing as if another Publisher had written."""
    from luopan.errors import StorageError

    trainer, worker, pub, sub = _published(tmp_path, 2)
    real = luopan.sync.targets.fsync_dir
    calls = []

    def fail_last(path):
        calls.append(path)
        if os.path.samefile(path, tmp_path / "ch"):
            raise OSError(5, "Input/output error")
        return real(path)

    train_step(trainer, 2)
    monkeypatch.setattr(luopan.sync.targets, "fsync_dir", fail_last)
    with pytest.raises(StorageError):
        pub.publish(2, trainer)
    monkeypatch.undo()
    assert sub.update(worker) == 3 and bits(worker) == bits(trainer)  # the placed index is what is served
    train_step(trainer, 3)
    assert pub.publish(3, trainer) == 4 and "full" in pub.last_bytes
    assert sub.update(worker) == 4 and bits(worker) == bits(trainer)


def test_a_second_publisher_that_wrote_the_same_version_is_noticed(tmp_path):
    """Two Publishers racing on one target (an object store has no lock) both publish version 2; the second index
    replaces the first. The version number is the one the first wrote, but not its bytes: its next publish is
    refused."""
    import dataclasses

    from luopan.errors import UsageError

    trainer = make_model(0)
    a = luopan.sync.Publisher(tmp_path / "ch")
    a.publish(0, trainer)
    train_step(trainer, 1)
    a.publish(1, trainer)
    index_path = tmp_path / "ch" / "index.json"
    mine = luopan.sync.index.parse_index(index_path.read_bytes())
    theirs = dataclasses.replace(mine, created="2026-01-01T00:00:00Z")  # another writer's version 2
    index_path.write_bytes(luopan.sync.index.encode_index(theirs, None))
    train_step(trainer, 2)
    with pytest.raises(UsageError, match="another Publisher"):
        a.publish(2, trainer)


def test_a_target_of_the_older_format_is_continued(tmp_path):
    """An index.json of format_version 1 (before layered delta files): a Publisher goes on from its version with a
    full version, and the old files are removed."""
    import json

    root = tmp_path / "ch"
    (root / "deltas").mkdir(parents=True)
    (root / "deltas" / "00000006-00000007-0123456789abcdef.lpsync").write_bytes(b"old")
    (root / "index.json").write_text(json.dumps({"channel": "sync", "format": "luopan-sync-index",
                                                 "format_version": 1, "version": 7}))
    trainer, worker = make_model(0), make_model(1)
    pub = luopan.sync.Publisher(root)
    assert pub.version == 7 and pub.publish(0, trainer) == 8
    pub.wait()
    assert not (root / "deltas" / "00000006-00000007-0123456789abcdef.lpsync").exists()
    assert luopan.sync.Subscriber(root).update(worker) == 8 and bits(worker) == bits(trainer)


def test_cleanup_leaves_a_newer_publishers_files(tmp_path):
    """The removal after a publish runs without the lock: it never deletes a file of a later version than the
    index it cleans up after."""
    from luopan.sync.targets import _removable

    keep = {"deltas/00000003-00000005-aa.lpsync", "full/00000004-bb.lpsync"}
    assert not _removable("deltas/00000003-00000005-aa.lpsync", keep, 5)
    assert _removable("deltas/00000002-00000004-cc.lpsync", keep, 5)
    assert not _removable("deltas/00000004-00000006-dd.lpsync", keep, 5)  # a newer Publisher's
    assert not _removable("full/00000006-ee.lpsync", keep, 5)
    assert _removable("full/00000003-ff.lpsync", keep, 5)
    assert not _removable("deltas/notes.txt", keep, 5)

"""Hostile live-sync files (docs/format.md §§19.1-19.3), fuzzed with hypothesis: mutated delta files — listed by a
correctly signed index, so they reach the parser — are refused with a typed error and the live tensors are left
exactly as they were, or they apply and give exactly the published weights; mutated delta headers and sync indexes
parse to something valid or are refused with a LuopanError, in memory bounded by their size."""

from __future__ import annotations

import dataclasses
import os
import struct
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import luopan.sync
from luopan.channel.index import FileRef
from luopan.errors import LuopanError
from luopan.format.canonical import canonical
from luopan.signing import TrustedKeys, generate_key, load_signing_key
from luopan.sync.delta import MAGIC, parse_delta
from luopan.sync.index import encode_index, parse_index
from tests.test_fuzz_parsers import SUPPRESS, VALUES, byte_mutations
from tests.test_sync import bits, train_step
from tests.test_sync import make_model as small_model

BIG = 4096  # a buffer whose sparse changes are coded gaps16 (64 elements and more, smaller than a bitmap)


def make_model(seed: int) -> torch.nn.Module:
    m = small_model(seed)
    m.register_buffer("big", torch.zeros(BIG, dtype=torch.bfloat16))
    return m


def big_step(m: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        m.big[torch.randperm(BIG, generator=g)[:100]] += 1

FUZZ_EXAMPLES = int(os.environ.get("LUOPAN_FUZZ_EXAMPLES", "200"))


class Channel:
    """A signed channel of three versions (a full version 1, a delta file of two layers: 1->3) and a worker state
    at version 1."""

    def __init__(self, root: str) -> None:
        key_path, pub = generate_key(os.path.join(root, "keys"))
        os.makedirs(os.path.join(root, "trusted"))
        os.replace(pub, os.path.join(root, "trusted", "k.pub"))
        self.key, self.trusted = load_signing_key(key_path), TrustedKeys.load(os.path.join(root, "trusted"))
        self.dir = os.path.join(root, "ch")
        trainer = make_model(0)
        self.pub = luopan.sync.Publisher(self.dir, key=self.key, keep=3)
        train_step(trainer, 0)
        self.pub.publish(0, trainer)
        self.v1 = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
        for step in (1, 2):
            train_step(trainer, step)
            big_step(trainer, step)
            self.pub.publish(step, trainer)
        self.v2 = bits(trainer)
        self.index = parse_index(open(os.path.join(self.dir, "index.json"), "rb").read())
        self.delta = self.index.deltas[0]
        assert self.delta.source == 1 and self.delta.file.size == os.path.getsize(
            os.path.join(self.dir, self.delta.file.name))  # the whole file: both layers
        self.delta_bytes = open(os.path.join(self.dir, self.delta.file.name), "rb").read()
        modes = {t.mode for layer in parse_delta(self.delta_bytes)[0].layers for t in layer.tensors}
        assert {"gaps", "gaps16", "whole"} <= modes, modes  # the fuzz reaches every coding of the index
        self.full = self.index.versions[0].full
        self.full_bytes = open(os.path.join(self.dir, self.full.name), "rb").read()

    def serve(self, delta: bytes, full: bytes | None = None) -> None:
        """List ``delta`` (and ``full``) in a correctly signed index."""
        import blake3

        def ref(f: FileRef, data: bytes) -> FileRef:
            return FileRef(f.name, max(1, len(data)), blake3.blake3(data).hexdigest())

        open(os.path.join(self.dir, self.delta.file.name), "wb").write(delta)
        deltas = (dataclasses.replace(self.delta, file=ref(self.delta.file, delta)),)
        versions = self.index.versions
        if full is not None:
            open(os.path.join(self.dir, self.full.name), "wb").write(full)
            versions = (dataclasses.replace(versions[0], full=ref(self.full, full)), *versions[1:])
        index = dataclasses.replace(self.index, deltas=deltas, versions=versions)
        open(os.path.join(self.dir, "index.json"), "wb").write(encode_index(index, self.key))


@pytest.fixture(scope="module")
def channel(tmp_path_factory) -> Channel:
    return Channel(str(tmp_path_factory.mktemp("sync-hostile")))


def _apply(ch: Channel, fresh: bool) -> None:
    """Update a worker (at version 1, or a fresh one: full + delta) through the served files: refused with the
    tensors untouched, or applied exactly."""
    worker = make_model(5)
    if not fresh:
        worker.load_state_dict(ch.v1)
    before = bits(worker)
    sub = luopan.sync.Subscriber(ch.dir, trusted_keys=ch.trusted)
    try:
        applied = sub.update(worker)
    except LuopanError:
        assert bits(worker) == before
        return
    assert applied == 3 and bits(worker) == ch.v2


@st.composite
def header_mutations(draw: Any, sample: bytes) -> bytes:
    """A delta with its header structurally mutated (re-encoded canonical) and the body kept."""
    (hlen,) = struct.unpack_from("<I", sample, len(MAGIC))
    start = len(MAGIC) + 4
    import json

    doc = json.loads(sample[start:start + hlen])
    for _ in range(draw(st.integers(1, 3))):
        t = draw(st.sampled_from(["top", "layer", "tensor"]))
        layers = doc.get("layers") if isinstance(doc, dict) else None
        layer_docs = [x for x in layers if isinstance(x, dict)] if isinstance(layers, list) else []
        tensors = [x for lay in layer_docs if isinstance(lay.get("tensors"), list) for x in lay["tensors"]]
        dicts = [x for x in tensors if isinstance(x, dict)]
        if t == "tensor" and dicts:  # an earlier mutation may have replaced the list or its members
            tdoc = dicts[draw(st.integers(0, len(dicts) - 1))]
        elif t == "layer" and layer_docs:
            tdoc = layer_docs[draw(st.integers(0, len(layer_docs) - 1))]
        else:
            tdoc = doc
        k = draw(st.sampled_from(sorted(tdoc) + ["extra"]))
        if draw(st.booleans()) and k in tdoc:
            del tdoc[k]
        else:
            tdoc[k] = draw(st.one_of(VALUES, st.integers(-1, 1 << 20),
                                     st.sampled_from(["gaps", "gaps16", "bitmap", "whole"])))
    try:
        header = canonical(doc)
    except (ValueError, TypeError):
        header = b"{}"
    return MAGIC + struct.pack("<I", len(header)) + header + sample[start + hlen:]


def test_fuzz_served_delta_bytes(channel):
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=SUPPRESS,
              derandomize=FUZZ_EXAMPLES <= 200)
    @given(data=st.one_of(byte_mutations(channel.delta_bytes), header_mutations(channel.delta_bytes)))
    def run(data: bytes) -> None:
        channel.serve(data)
        _apply(channel, fresh=False)

    try:
        run()
    finally:
        channel.serve(channel.delta_bytes)


def test_fuzz_served_full_version(channel):
    @settings(max_examples=max(20, FUZZ_EXAMPLES // 4), deadline=None, suppress_health_check=SUPPRESS,
              derandomize=True)
    @given(data=st.one_of(byte_mutations(channel.full_bytes), header_mutations(channel.full_bytes)))
    def run(data: bytes) -> None:
        channel.serve(channel.delta_bytes, data)
        _apply(channel, fresh=True)

    try:
        run()
    finally:
        channel.serve(channel.delta_bytes, channel.full_bytes)


def _bounded(parse: Any, data: bytes) -> Any:
    tracemalloc.start()
    try:
        return parse(data)
    except LuopanError:
        return None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 64 * len(data) + (16 << 20), f"parsing {len(data)} bytes allocated {peak} bytes"


def test_fuzz_delta_parser(channel):
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=SUPPRESS,
              derandomize=FUZZ_EXAMPLES <= 200)
    @given(data=st.one_of(st.binary(max_size=512), byte_mutations(channel.delta_bytes),
                          header_mutations(channel.delta_bytes)))
    def run(data: bytes) -> None:
        out = _bounded(lambda d: parse_delta(d, max_body=1 << 20), data)
        if out is not None:
            header, layers = out
            assert [layer.version for layer, _parts in layers] == \
                list(range(header.target, header.target - len(layers), -1))
            for layer, parts in layers:
                for t, idx, values in parts:
                    assert len(values) == t.value_bytes
                    assert idx is None or (idx.size == t.count and
                                           (idx.size == 0 or 0 <= idx[0] <= idx[-1] < t.numel))

    run()


def test_fuzz_sync_index_parser(channel):
    sample = open(os.path.join(channel.dir, "index.json"), "rb").read()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=SUPPRESS,
              derandomize=FUZZ_EXAMPLES <= 200)
    @given(data=st.one_of(st.binary(max_size=512), byte_mutations(sample)))
    def run(data: bytes) -> None:
        index = _bounded(parse_index, data)
        if index is not None:
            assert index.versions[-1].version == index.version
            assert all(d.target == index.version for d in index.deltas)

    run()


@pytest.mark.parametrize("data", [b"", MAGIC, MAGIC + b"\xff\xff\xff\xff", MAGIC + struct.pack("<I", 2) + b"{}",
                                  b"\x00" * 100])
def test_pathological_delta_files(data):
    assert _bounded(parse_delta, data) is None

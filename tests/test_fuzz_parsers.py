"""Fuzz every parser luopan has with hypothesis: manifest, index file, pack trailer, repository config, ref, pin,
lock record, run record, eval log, gc record and tier config.

Inputs: random bytes; byte-level mutations of valid files (flips, truncations, insertions, splices); structural
mutations of valid documents that are then *sealed again* (so the checksum passes and the validation behind it is
what is tested): extreme integers, wrong types, deep nesting, removed and added members, duplicate keys. Every
outcome must be a correct parse or a luopan error, never another exception; and no parser may allocate memory in
proportion to a size a file declares before checking it (tracemalloc bounds each parse by its input's size).

Bounded in CI (``FUZZ_EXAMPLES`` per parser and strategy); ``make test-slow`` runs the ``slow`` copies with many
more examples.
"""

from __future__ import annotations

import json
import math
import os
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from luopan.format.config import CONFIG_CODECS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import luopan
from luopan.repository.chunkio import read_trailer
from luopan.checkpoint.runs.record import parse_eval, parse_record
from luopan.repository.pins import parse_pin
from luopan.errors import LuopanError
from luopan.format.canonical import canonical, seal, unseal
from luopan.format.config import RepoConfig
from luopan.format.index import parse_index
from luopan.format.limits import MAX_OFFSET, shape_fits
from luopan.format.manifest import parse_manifest, stored_rows
from luopan.format.names import is_hex64, is_run_name
from luopan.format.pack import CODECS, PackFormatError, parse_trailer
from luopan.format.refs import parse_ref
from luopan.repository.gc import parse_condemned
from luopan.repository.locks import Lock, parse_lock
from luopan.repository.tiersetup import parse_tier_config
from luopan.store import MemoryStore
from luopan.tree import itemsize

FUZZ_EXAMPLES = int(os.environ.get("LUOPAN_FUZZ_EXAMPLES", "200"))
SLOW_EXAMPLES = 3000


def _pack_trailer(data: bytes) -> Any:
    """Both trailer parsers: from bytes in memory, and from a store (where the declared length is checked against
    the real size before anything that long is read)."""
    try:
        parse_trailer(data[:16], data[-(1 << 20):], len(data))
    except PackFormatError:
        pass
    store = MemoryStore()
    store.put(f"packs/{'a' * 2}/{'a' * 64}.pack", data)
    try:
        return read_trailer(store, "a" * 64)
    except PackFormatError:
        return None


# name -> (parse function taking the file's bytes, errors it may raise besides LuopanError)
PARSERS: dict[str, tuple[Callable[[bytes], Any], tuple[type[BaseException], ...]]] = {
    "manifest": (lambda d: parse_manifest(d, "runs/r/ckpt/00000002.json", "r", 2), ()),
    "index": (lambda d: parse_index(d, "index/x.json"), ()),
    "pack": (_pack_trailer, ()),
    "config": (lambda d: RepoConfig.from_bytes(d, "luopan.json"), ()),
    "ref": (lambda d: parse_ref(d, "refs/runs/r/latest.json"), ()),
    "pin": (lambda d: parse_pin(d, "refs/pins/r/00000001.json", "r", 1), ()),
    "lock": (lambda d: parse_lock("locks/shared-0123456789abcdef.json", d), ()),
    "record": (lambda d: parse_record(d, "runs/r/record.json", "r"), ()),
    "eval": (lambda d: parse_eval(d, "runs/r/evals/00000002.json", "r", 2), ()),
    "condemned": (lambda d: parse_condemned(d), ()),
    "tier-config": (lambda d: parse_tier_config(d, "tier/config.json"), ()),
}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict[str, bytes]:
    """One valid file of each kind, from a real repository (with a row delta, aliases, a pin, an eval)."""
    root = tmp_path_factory.mktemp("fuzz") / "repo"
    policy = luopan.DeltaPolicy(min_bytes=1024)
    with luopan.open(root, chunk_size=4096, pack_size=1 << 16, compression="zstd", delta_policy=policy) as repo:
        table = np.arange(4000, dtype=np.float32).reshape(500, 8)
        w = np.ones(5, np.float32)
        repo.save("r", 1, {"t": table, "w": w, "tied": w, "cfg": {"lr": 0.1, "n": [1, 2]}}, metrics={"loss": 1.0})
        table[3] += 1
        repo.save("r", 2, {"t": table, "w": w, "tied": w, "cfg": {"lr": 0.1, "n": [1, 2]}},
                  metrics={"loss": 0.5, "nan": float("nan")})
        repo.run("r").pin(1, "keep")
        repo.run("r").log_eval(2, {"acc": 0.5}, samples=[{"q": "x", "a": [1, 2]}])
        pack = repo.manifest("r", 2).packs[0]
    out = {
        "manifest": (root / "runs/r/ckpt/00000002.json").read_bytes(),
        "index": next((root / "index").glob("*.json")).read_bytes(),
        "pack": (root / "packs" / pack[:2] / f"{pack}.pack").read_bytes(),
        "config": (root / "luopan.json").read_bytes(),
        "ref": (root / "refs/runs/r/latest.json").read_bytes(),
        "pin": (root / "refs/pins/r/00000001.json").read_bytes(),
        "lock": Lock(MemoryStore(), "shared", "save of r step 3")._record(),
        "record": (root / "runs/r/record.json").read_bytes(),
        "eval": (root / "runs/r/evals/00000002.json").read_bytes(),
        "condemned": seal({"format_version": 1, "packs": {"b" * 64: 1700000000.5}}),
        "tier-config": seal({"format_version": 1, "replicate_to": "s3://bucket/x",
                             "cold": {"url": "s3://cold/x", "older_than": "7d"}}),
    }
    for name, data in out.items():  # every sample is valid: the fuzz starts from files the parsers accept
        PARSERS[name][0](data)
    return out


def _int(v: Any, hi: int = MAX_OFFSET) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= hi


def _post_manifest(m: Any) -> None:
    assert is_run_name(m.run) and m.step == 2
    for e in m.entries:
        assert isinstance(e["path"], str) and shape_fits(e["shape"], itemsize(e["kind"], e["dtype"]))
        for row in stored_rows(e):
            assert row[1] < len(m.packs) and all(_int(v) for v in row[2:5])


def _post_index(out: Any) -> None:
    for h, loc in out.items():
        assert is_hex64(h) and is_hex64(loc.pack) and loc.codec in CODECS
        assert all(_int(v) for v in (loc.offset, loc.length, loc.size))


def _post_pack(out: Any) -> None:
    if out is not None:
        _pid, blobs = out
        for b in blobs:
            assert is_hex64(b["hash"]) and b["codec"] in CODECS and all(_int(b[k]) for k in ("offset", "length",
                                                                                              "size"))


def _post_lock(rec: Any) -> None:
    assert rec.kind in ("shared", "exclusive", "waiting") and 0 < rec.pid < 2**31
    for t in (rec.created, rec.refreshed):
        assert math.isfinite(t) and 0 <= t <= 2**34
    rec.describe(), rec.stale_reason(), rec.to_json()  # noqa: B018 - they must not raise either


def _post_condemned(out: Any) -> None:
    assert all(is_hex64(p) and math.isfinite(t) for p, t in out.items())


def _post_doc(**types: Any) -> Callable[[Any], None]:
    def post(doc: Any) -> None:
        for k, t in types.items():
            assert isinstance(doc.get(k), t), (k, doc.get(k))
    return post


# name -> what a successful parse must guarantee (a correct parse, not merely no exception)
POST: dict[str, Callable[[Any], None]] = {
    "manifest": _post_manifest,
    "index": _post_index,
    "pack": _post_pack,
    "config": lambda c: (_int(c.chunk_size) and _int(c.pack_size) and c.compression.codec in CONFIG_CODECS) or 1 / 0,
    "ref": _post_doc(manifest=str, step=int, manifest_checksum=str),
    "pin": _post_doc(run=str, step=int, created=str, tag=(str, type(None))),
    "lock": _post_lock,
    "record": _post_doc(run=str, argv=list, environment=dict, packages=dict, git=(dict, type(None))),
    "eval": _post_doc(run=str, step=int, metrics=dict, samples=list),
    "condemned": _post_condemned,
    "tier-config": _post_doc(replicate_to=(str, type(None)), cold=(dict, type(None))),
}


def check(name: str, data: bytes) -> None:
    """Parse ``data``: a correct result (POST holds) or a LuopanError, with memory bounded by the input's size."""
    parse, also = PARSERS[name]
    tracemalloc.start()
    try:
        result = parse(data)
    except LuopanError:
        return
    except also:
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= 64 * len(data) + (8 << 20), f"{name}: parsing {len(data)} bytes allocated {peak} bytes"
    POST[name](result)


# -- strategies -----------------------------------------------------------------------------------------------------
EXTREME_INTS = st.sampled_from([0, -1, 1, 2**31, 2**32, 2**48, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -2**63,
                                10**15, 10**15 - 1, 10**30, 10**300])
NASTY_STRINGS = st.sampled_from(["", "\n", "a\nb", "\0", "..", "../x", "/abs", "a/b", "x" * 10_000, "ех", "\u202e",
                                 "NaN", "Infinity", "none", "zstd", "float32", "torch", "numpy", "0" * 64,
                                 "blake3:" + "0" * 64, "2026-01-01T00:00:00+00:00", "2026-01-01T00:00:00"])
LEAVES = st.one_of(EXTREME_INTS, NASTY_STRINGS, st.booleans(), st.none(),
                   st.floats(allow_nan=False, allow_infinity=False), st.integers(), st.text(max_size=20))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _nodes(doc: Any, limit: int = 40) -> list[tuple]:
    """Paths to the nodes of a document, not below depth ``limit`` (a nested mutation may be thousands deep)."""
    out, stack = [], [((), doc)]
    while stack:
        path, node = stack.pop()
        out.append(path)
        if len(path) >= limit:
            continue
        if isinstance(node, dict):
            stack += [(path + (k,), v) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(path + (i,), v) for i, v in enumerate(node)]
    return sorted(out, key=lambda p: (len(p), [str(x) for x in p]))


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _replace(doc[path[0]], path[1:], value)
    return doc


def _delete(doc: Any, path: tuple) -> None:
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    del parent[path[-1]]


@st.composite
def resealed(draw: Any, sample: bytes) -> bytes:
    """A structurally mutated copy of a sealed document, sealed again."""
    doc = unseal(sample)
    for _ in range(draw(st.integers(1, 3))):
        nodes = _nodes(doc)
        path = draw(st.sampled_from(nodes))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add", "nest"]))
        if action == "replace":
            doc = _replace(doc, path, draw(VALUES))
        elif action == "delete" and path:
            _delete(doc, path)
        elif action == "add":
            target = doc
            for p in path:
                target = target[p]
            if isinstance(target, dict):
                target[draw(st.text(max_size=10))] = draw(VALUES)
            elif isinstance(target, list):
                target.insert(draw(st.integers(0, len(target))), draw(VALUES))
        elif action == "nest":
            depth = draw(st.sampled_from([10, 200, 900, 5000]))
            value: Any = 1
            for _ in range(depth):
                value = [value]
            doc = _replace(doc, path, value)
    try:
        return seal(doc) if isinstance(doc, dict) else canonical(doc)
    except (ValueError, TypeError, RecursionError):
        assume(False)
        raise AssertionError("unreachable")


@st.composite
def byte_mutations(draw: Any, sample: bytes) -> bytes:
    data = bytearray(sample)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "dup-key"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.sampled_from([b"[" * 3000, b"9" * 5000, b"1e400", b"-", b",", b"\xff\xfe",
                                                  b'"\\ud800"', b"\x00", b"{}", b"null"]))
        elif kind == "splice":
            n = draw(st.integers(1, 64))
            data[pos:pos] = data[max(0, pos - n):pos]
        elif kind == "dup-key" and data.startswith(b"{"):
            data[1:1] = b'"format_version":1,'  # a member given twice
    return bytes(data)


SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture,
            HealthCheck.filter_too_much]


def _fuzz(samples: dict[str, bytes], name: str, strategy: str, examples: int) -> None:
    sample = samples[name]
    if strategy == "random":
        gen = st.binary(max_size=2048)
    elif strategy == "bytes":
        gen = byte_mutations(sample)
    else:
        if name == "pack":
            pytest.skip("pack trailers are not sealed JSON documents: covered by the byte strategies")
        gen = resealed(sample)

    @settings(max_examples=examples, deadline=None, suppress_health_check=SUPPRESS, derandomize=examples <= 200)
    @given(data=gen)
    def run(data: bytes) -> None:
        check(name, data)

    run()


@pytest.mark.parametrize("strategy", ["random", "bytes", "resealed"])
@pytest.mark.parametrize("name", list(PARSERS))
def test_fuzz_parser(samples, name, strategy):
    _fuzz(samples, name, strategy, FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["random", "bytes", "resealed"])
@pytest.mark.parametrize("name", list(PARSERS))
def test_fuzz_parser_long(samples, name, strategy):
    _fuzz(samples, name, strategy, SLOW_EXAMPLES)


# -- targeted cases the strategies reach only by luck ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"null", b"1e400", b"[" * 100_000, b'{"a":1,"a":2}',
                                  b"\xff" * 100, b"{" + b'"a":' * 50_000, b"9" * 10_000])
def test_pathological_inputs(samples, name, data):
    check(name, data)


@pytest.mark.parametrize("name", [n for n in PARSERS if n != "pack"])
def test_duplicate_keys_are_refused_even_when_sealed(samples, name):
    """A member given twice: readers disagree on which wins, so the file is refused (its seal cannot help)."""
    body = json.loads(samples[name])
    body.pop("checksum", None)
    first = next(iter(sorted(body)))
    sealed = seal(body)
    dup = sealed[:-1] + b"," + json.dumps(first).encode() + b":" + json.dumps(body[first]).encode() + b"}"
    with pytest.raises(LuopanError):
        PARSERS[name][0](dup)


def test_a_pack_trailer_declaring_a_huge_length_is_refused_before_reading():
    data = bytearray(b"LUOPANPK" + (1).to_bytes(4, "little") + bytes(4) + b"x" * 100)
    data += (2**62).to_bytes(8, "little") + b"LPIX"
    store = MemoryStore()
    store.put("packs/aa/" + "a" * 64 + ".pack", bytes(data))
    with pytest.raises(PackFormatError, match="length out of range"):
        read_trailer(store, "a" * 64)

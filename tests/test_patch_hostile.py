"""Hostile and damaged patches and bases (docs/format.md §13.4): every one refused with a typed error before any
output is written, an existing output untouched, no temporary file left; and the patch reader fuzzed with
hypothesis (byte mutations of a whole patch through ``apply``, structural mutations of its header)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import luopan
import luopan.patch
from luopan.errors import LuopanError
from luopan.format.canonical import canonical
from luopan.patch.container import PREFIX, prefix_bytes
from luopan.patch.fingerprint import content_fingerprint
from luopan.patch.header import parse_header

FUZZ_EXAMPLES = int(os.environ.get("LUOPAN_FUZZ_EXAMPLES", "200"))


class Small:
    """A tiny repository (4 KiB chunks), a patch from step 1 to step 2, the base and target exports."""

    def __init__(self, root: str) -> None:
        self.root = root
        repo = luopan.open(os.path.join(root, "repo"), chunk_size=4096)
        g = torch.Generator().manual_seed(1)
        m = {"a": torch.randn(32, 64, generator=g), "b": torch.arange(3000, dtype=torch.int16),
             "c": torch.zeros(5)}
        repo.save("r", 1, {"model": m})
        m["a"][3] += 1
        m["d"] = torch.ones(700)  # compresses: a zstd blob
        m["e"] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)  # does not: stored raw
        repo.save("r", 2, {"model": m})
        self.base, self.target, self.patch = (os.path.join(root, n) for n in ("base.st", "target.st", "p.lpatch"))
        repo.export("r", self.base, 1, subtree="model")
        repo.export("r", self.target, 2, subtree="model")
        luopan.patch.create(repo, "r", 1, 2, self.patch, subtree="model")
        repo.close()
        self.data = open(self.patch, "rb").read()
        _magic, _v, self.hlen, self.slen, _r = PREFIX.unpack(self.data[: PREFIX.size])
        self.header = json.loads(self.data[PREFIX.size : PREFIX.size + self.hlen])
        self.body = self.data[PREFIX.size + self.hlen + self.slen :]
        self.out = os.path.join(root, "out.st")

    def rebuild(self, mutate: Callable[[dict[str, Any]], Any] | None = None, *, refingerprint: bool = True,
                header: bytes | None = None, body: bytes | None = None) -> bytes:
        """The patch with its header changed by ``mutate`` (target fingerprint recomputed unless told not to), or
        replaced by raw ``header`` bytes."""
        if header is None:
            header = canonical(self.header_doc(mutate, refingerprint))
        return prefix_bytes(header, b"") + header + (self.body if body is None else body)

    def header_doc(self, mutate: Callable[[dict[str, Any]], Any] | None, refingerprint: bool) -> dict[str, Any]:
        doc = json.loads(json.dumps(self.header))
        if mutate is not None:
            mutate(doc)
        if refingerprint:
            try:
                doc["target"]["fingerprint"] = content_fingerprint(
                    doc["chunk_size"], ((t["name"], t["dtype"], t["shape"], [c[0] for c in t["chunks"]])
                                        for t in doc["tensors"]))
            except (TypeError, KeyError, IndexError, ValueError, AttributeError):
                pass
        return doc

    def refused(self, data: bytes, error: type[BaseException], match: str, base: str | None = None) -> None:
        """``data`` as a patch is refused with ``error`` (message matching), the existing output untouched."""
        path = os.path.join(self.root, "hostile.lpatch")
        with open(path, "wb") as f:
            f.write(data)
        with open(self.out, "wb") as f:
            f.write(b"existing")
        with pytest.raises(error, match=match):
            luopan.patch.apply(path, base or self.base, self.out)
        assert open(self.out, "rb").read() == b"existing"
        assert [n for n in os.listdir(self.root) if ".tmp-" in n] == []


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return Small(str(tmp_path_factory.mktemp("hostile")))


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return mutate


@pytest.mark.parametrize("name", ["../../etc/passwd", "/abs", "a/../b", "a/./b", "a//b", "a\\b", "a\x00b",
                                  "tab\tname", "__metadata__", "", "a/"])
def test_names_that_could_escape_or_confuse_are_refused(small, name):
    small.refused(small.rebuild(_set(["tensors", 0, "name"], name)), luopan.CorruptPatchError, "name")


HEADER_DAMAGE = [
    (_set(["tensors", 0, "shape"], [2**40, 2**40]), "impossible shape"),
    (_set(["tensors", 0, "shape"], [2**30, 2**10]), "must have"),  # 4 TiB declared: counted, never listed
    (_set(["tensors", 0, "shape"], [1] * 65), "impossible shape"),
    (_set(["tensors", 0, "shape"], [-1, 64]), "impossible shape"),
    (_set(["tensors", 0, "shape"], [True, 64]), "impossible shape"),
    (_set(["tensors", 0, "dtype"], "object"), "unknown dtype"),
    (_set(["tensors", 0, "chunks", 0, 1], 10**30), "chunk 0"),
    (_set(["tensors", 1, "name"], "a"), "listed twice"),
    (_set(["chunk_size"], 1 << 40), "chunk_size"),
    (_set(["chunk_size"], 8192), "must have"),
    (_set(["body_bytes"], 10**18), "body_bytes"),
    (_set(["blobs", 0, 1], 10**15), "offset"),
    (_set(["blobs", 0, 4], "lz4"), "impossible sizes"),
    (_set(["blobs", 0, 3], 2**40), "impossible sizes"),
    (_set(["blobs", 0, 0], "f" * 64), "not a chunk of any target tensor"),
    (lambda d: d["blobs"].append(d["blobs"][0]), "listed twice"),
    (_set(["metadata"], {"format": "pt"}), "metadata"),
    (_set(["subtree"], "../up"), "subtree"),
    (_set(["target", "run"], "../run"), "target is not"),
    (_set(["target", "step"], -1), "target is not"),
    (_set(["target", "tensors"], 99), "declares"),
    (_set(["base", "fingerprint"], "md5:abc"), "base is not"),
    (_set(["extra"], 1), "unknown members"),
    (lambda d: d.pop("created"), "missing"),
    (_set(["format"], "something-else"), "format is"),
    (_set(["format_version"], True), "format_version"),
    # whole-number floats equal their ints in Python: refused as members that must be JSON integers
    (_set(["format_version"], 1.0), "format_version"),
    (lambda d: d["tensors"][0]["chunks"][0].__setitem__(1, float(d["tensors"][0]["chunks"][0][1])), "chunk 0"),
    (lambda d: d.__setitem__("body_bytes", float(d["body_bytes"])), "body_bytes"),
    (lambda d: d["blobs"][1].__setitem__(1, float(d["blobs"][1][1])), "offset"),
    (lambda d: d["blobs"][0].__setitem__(2, float(d["blobs"][0][2])), "impossible sizes"),
    (lambda d: d["target"].__setitem__("bytes", float(d["target"]["bytes"])), "declares"),
    (lambda d: d["target"].__setitem__("tensors", float(d["target"]["tensors"])), "declares"),
    (lambda d: d["base"].__setitem__("bytes", float(d["base"]["bytes"])), "base is not"),
    (_set(["chunk_size"], 4096.0), "chunk_size"),
    (lambda d: d["tensors"][0].__setitem__("shape", [float(x) for x in d["tensors"][0]["shape"]]), "impossible shape"),
]

# lone surrogates: JSON can escape them, no UTF-8 file can hold them (the output's header could not be read back)
SURROGATES = [
    (_set(["metadata"], [["format", "pt\ud800"]]), "metadata"),
    (_set(["metadata"], [["\udfff", "pt"]]), "metadata"),
    (_set(["tensors", 0, "name"], "a\ud800"), "name"),
    (_set(["base", "source"], "\ud800"), "base is not"),
]


@pytest.mark.parametrize("mutate,match", HEADER_DAMAGE, ids=[m for _f, m in HEADER_DAMAGE])
def test_damaged_or_hostile_headers_are_refused(small, mutate, match):
    small.refused(small.rebuild(mutate), luopan.CorruptPatchError, match)


@pytest.mark.parametrize("mutate,match", SURROGATES, ids=[m for _f, m in SURROGATES])
def test_lone_surrogates_are_refused(small, mutate, match):
    header = json.dumps(small.header_doc(mutate, refingerprint=True), sort_keys=True, separators=(",", ":")).encode()
    assert b"\\ud" in header or b"\\udfff" in header  # escaped: the JSON itself is valid ASCII
    small.refused(small.rebuild(header=header), luopan.CorruptPatchError, match)


def test_a_header_must_match_its_target_fingerprint(small):
    small.refused(small.rebuild(_set(["tensors", 1, "chunks", 0, 0], "e" * 64), refingerprint=False),
                  luopan.CorruptPatchError, "fingerprint")


def test_newer_versions_are_refused_as_such(small):
    small.refused(small.rebuild(_set(["format_version"], 2)), luopan.UnsupportedFormatError, "upgrade luopan")
    newer = bytearray(small.data)
    newer[8:12] = struct.pack("<I", 2)
    small.refused(bytes(newer), luopan.UnsupportedFormatError, "container version 2")


def test_duplicate_keys_and_deep_nesting_are_refused(small):
    header = canonical(small.header)
    small.refused(small.rebuild(header=b'{"base":1,' + header[1:]), luopan.CorruptPatchError, "duplicate key")
    small.refused(small.rebuild(header=b"[" * 100_000 + b"]" * 100_000), luopan.CorruptPatchError, "nested|object")
    small.refused(small.rebuild(header=b"\xff\xfe{}"), luopan.CorruptPatchError, "not valid JSON")


def test_prefix_limits_are_checked_before_reading(small):
    def prefix(h: int, s: int, magic: bytes = b"LUOPANPT", reserved: int = 0) -> bytes:
        return PREFIX.pack(magic, 1, h, s, reserved) + small.data[PREFIX.size :]

    small.refused(prefix(0xFFFF_FFFF, 0), luopan.CorruptPatchError, "over the limit")
    small.refused(prefix(small.hlen, 5000), luopan.CorruptPatchError, "over the limit")
    small.refused(prefix((8 << 20) + 1, 0), luopan.CorruptPatchError, "over the limit")
    small.refused(prefix(8 << 20, 0), luopan.CorruptPatchError, "truncated")
    small.refused(prefix(small.hlen, 0, reserved=7), luopan.CorruptPatchError, "reserved")
    small.refused(prefix(small.hlen, 0, magic=b"NOTPATCH"), luopan.CorruptPatchError, "not a luopan patch")
    small.refused(b"", luopan.CorruptPatchError, "not a luopan patch")
    small.refused(small.data[:PREFIX.size + 10], luopan.CorruptPatchError, "truncated")


def test_truncated_or_extended_files_are_refused(small):
    small.refused(small.data[:-1], luopan.CorruptPatchError, "truncated")
    small.refused(small.data + b"\0", luopan.CorruptPatchError, "longer than its header says")


def test_damaged_blobs_are_refused(small):
    blobs = small.header["blobs"]
    raw = next(b for b in blobs if b[4] == "none")
    packed = next(b for b in blobs if b[4] == "zstd")
    start = raw[1]
    body = bytearray(small.body)
    body[start] ^= 1
    small.refused(small.rebuild(body=bytes(body)), luopan.CorruptPatchError, "is damaged")
    body = bytearray(small.body)
    body[packed[1] + packed[2] // 2] ^= 0x55
    small.refused(small.rebuild(body=bytes(body)), luopan.CorruptPatchError, "damaged|decompress")
    # a frame that decompresses to more than the chunk: a stream of extra bytes is never written
    frame = zstandard.ZstdCompressor().compress(bytes(packed[3] + 1))
    body = small.body[: packed[1]] + frame + small.body[packed[1] + packed[2] :]

    def longer(doc: dict[str, Any]) -> None:
        at = [b[0] for b in doc["blobs"]].index(packed[0])
        doc["blobs"][at][2] = len(frame)
        for b in doc["blobs"][at + 1 :]:
            b[1] += len(frame) - packed[2]
        doc["body_bytes"] += len(frame) - packed[2]

    small.refused(small.rebuild(longer, body=body), luopan.CorruptPatchError, "decompresses to more")


def test_wrong_and_damaged_bases_are_refused(small, tmp_path):
    small.refused(small.data, luopan.BaseMismatchError, "not the base this patch was made for", base=small.target)
    bad = tmp_path / "bad.st"
    base = open(small.base, "rb").read()
    for damaged, match in [(struct.pack("<Q", 10**12) + base[8:], "header length"),
                           (base[:100], "header length|outside"), (b"abc", "fewer than"),
                           (struct.pack("<Q", 2) + b"[]", "not a JSON object")]:
        bad.write_bytes(damaged)
        small.refused(small.data, luopan.CorruptSafetensorsError, match, base=str(bad))
    with pytest.raises(FileNotFoundError):
        luopan.patch.apply(small.patch, str(tmp_path / "missing.st"), small.out)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # never opened for a blocking read
    small.refused(small.data, luopan.CorruptSafetensorsError, "not a regular file", base=str(fifo))
    with pytest.raises(luopan.CorruptPatchError, match="not a regular file"):
        luopan.patch.apply(str(fifo), small.base, small.out)
    with pytest.raises(luopan.CorruptPatchError, match="not a regular file"):
        luopan.patch.apply(str(tmp_path), small.base, small.out)


def test_a_patch_cannot_make_a_base_cost_unbounded_bookkeeping(small, monkeypatch):
    monkeypatch.setattr("luopan.patch.basefile.MAX_BASE_CHUNKS", 3)
    small.refused(small.data, luopan.CorruptPatchError, "at most 3 are hashed")


def _frame(data: bytes, window_log: int) -> bytes:
    """A zstd frame of ``data`` edited by hand to declare a window of 2**window_log (no content size, so no
    single-segment frame: the window descriptor is what a decoder sizes its buffer by)."""
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_content_size=False).compress(data))
    assert frame[4] == 0  # frame header descriptor: no content size, not single-segment, no checksum, no dictionary
    frame[5] = (window_log - 10) << 3  # window descriptor: exponent only
    return bytes(frame)


def test_zstd_windows_are_capped_at_8_mib_whatever_the_chunk_size(small):
    from luopan.patch.prepare import MAX_WINDOW, WINDOW_LOG

    packed = next(b for b in small.header["blobs"] if b[4] == "zstd")
    raw = zstandard.ZstdDecompressor().decompress(small.body[packed[1] : packed[1] + packed[2]])

    def swap(frame: bytes) -> bytes:
        def fix(doc: dict[str, Any]) -> None:
            at = [b[0] for b in doc["blobs"]].index(packed[0])
            doc["blobs"][at][2] = len(frame)
            for b in doc["blobs"][at + 1 :]:
                b[1] += len(frame) - packed[2]
            doc["body_bytes"] += len(frame) - packed[2]
        return small.rebuild(fix, body=small.body[: packed[1]] + frame + small.body[packed[1] + packed[2] :])

    path = os.path.join(small.root, "window.lpatch")
    with open(path, "wb") as f:
        f.write(swap(_frame(raw, 23)))  # a conforming frame needing 8 MiB: decodes, even for a 4 KiB chunk
    out = os.path.join(small.root, "window.st")
    luopan.patch.apply(path, small.base, out)
    assert open(out, "rb").read() == open(small.target, "rb").read()
    os.unlink(out)
    small.refused(swap(_frame(raw, 24)), luopan.CorruptPatchError, "does not decompress")
    # what create writes (level 3, window 2**21) and what earlier patches hold (level 3's default) both fit
    assert MAX_WINDOW == 8 << 20 and WINDOW_LOG <= 23
    big = bytes(range(256)) * (64 << 10)  # 16 MiB
    for cctx in (zstandard.ZstdCompressor(level=3), zstandard.ZstdCompressor(
            compression_params=zstandard.ZstdCompressionParameters.from_level(3, window_log=WINDOW_LOG))):
        assert zstandard.get_frame_parameters(cctx.compress(big)).window_size <= MAX_WINDOW


def test_a_base_chunk_of_another_size_is_refused_before_writing(small):
    """A header naming a base chunk (by hash) with a size it does not have: CorruptPatchError, not a read of the
    wrong length that looks like a base changing under the apply."""
    from luopan.patch.basefile import hash_file

    fd = os.open(small.base, os.O_RDONLY)
    try:
        based = hash_file(fd, small.base, 4096)
    finally:
        os.close(fd)
    listed = {c[0] for t in small.header["tensors"] for c in t["chunks"]}
    other = next(h for h, (_off, n) in based.where.items() if h not in listed and n == 4096)
    c = next(t for t in small.header["tensors"] if t["name"] == "c")  # 20 bytes, taken from the base
    assert c["chunks"][0][1] == 20 and c["chunks"][0][0] in based.where

    def mutate(doc: dict[str, Any]) -> None:
        next(t for t in doc["tensors"] if t["name"] == "c")["chunks"][0][0] = other

    small.refused(small.rebuild(mutate), luopan.CorruptPatchError, "the base holds it as 4096 bytes")


def test_a_patch_shrinking_while_its_header_is_read_is_refused(small, monkeypatch):
    from luopan.patch import container

    path = os.path.join(small.root, "shrinks.lpatch")
    with open(path, "wb") as f:
        f.write(small.data)
    real = container.read_exact

    def shrinking(fd: int, out: memoryview, offset: int) -> int:
        os.truncate(path, PREFIX.size + 10)  # after the size was taken
        return real(fd, out, offset)

    monkeypatch.setattr(container, "read_exact", shrinking)
    with pytest.raises(luopan.CorruptPatchError, match="changed while it was read"):
        luopan.patch.apply(path, small.base, small.out)
    with open(path, "wb") as f:
        f.write(small.data)
    with pytest.raises(luopan.CorruptPatchError, match="changed while it was read"):
        luopan.patch.read_header(path)


def test_base_files_with_names_no_file_can_hold_are_refused(small, tmp_path):
    base = open(small.base, "rb").read()
    hlen = int.from_bytes(base[:8], "little")
    doc = json.loads(base[8 : 8 + hlen])
    data = base[8 + hlen :]
    for key, mutate in [("name", lambda d: d.__setitem__("a\ud800", d.pop("a"))),
                        ("__metadata__", lambda d: d.__setitem__("__metadata__", {"k": "v\udc00"}))]:
        d = dict(doc)
        mutate(d)
        head = json.dumps(d).encode()  # escaped: valid JSON, a lone surrogate once parsed
        bad = tmp_path / "surrogate.st"
        bad.write_bytes(len(head).to_bytes(8, "little") + head + data)
        small.refused(small.data, luopan.CorruptSafetensorsError, "lone surrogate", base=str(bad))
        with pytest.raises(luopan.CorruptSafetensorsError, match="lone surrogate"):
            luopan.patch.fingerprint_file(bad, 4096)
    # a header over 16 MiB is refused before it is read (safetensors allows 100 MB: ~1 GB once parsed)
    bad = tmp_path / "huge.st"
    with open(bad, "wb") as f:
        f.write(((16 << 20) + 1).to_bytes(8, "little") + b"{}")
        f.truncate(17 << 20)  # sparse
    small.refused(small.data, luopan.CorruptSafetensorsError, "over the 16777216-byte limit", base=str(bad))


# -- fuzzing -------------------------------------------------------------------------------------------------------
def _mutations() -> st.SearchStrategy[list[tuple[str, int, int]]]:
    op = st.tuples(st.sampled_from(["flip", "truncate", "insert", "zero"]), st.integers(0, 1 << 30),
                   st.integers(0, 255))
    return st.lists(op, min_size=1, max_size=4)


def _mutate(data: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, where, value in ops:
        if not buf:
            break
        i = where % len(buf)
        if kind == "flip":
            buf[i] ^= value or 1
        elif kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = bytes([value])
        else:
            buf[i : i + 8] = bytes(len(buf[i : i + 8]))
    return bytes(buf)


@settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_mutations())
def test_fuzz_byte_mutations_of_a_whole_patch(small, ops):
    """A mutated patch is refused with a luopan error (output untouched) or, if the mutation only touched what no
    check covers in an unsigned patch (the creation time, a metadata value), gives exactly the target's tensors."""
    data = _mutate(small.data, ops)
    path = os.path.join(small.root, "fuzz.lpatch")
    with open(path, "wb") as f:
        f.write(data)
    out = os.path.join(small.root, "fuzz-out.st")
    if os.path.exists(out):
        os.unlink(out)
    try:
        luopan.patch.apply(path, small.base, out)
    except LuopanError:
        assert not os.path.exists(out)
    else:
        got, want = load_file(out), load_file(small.target)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [n for n in os.listdir(small.root) if ".tmp-" in n] == []


_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
                     | st.floats(allow_nan=False, allow_infinity=False),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=8)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += _paths(v, prefix + (i,))
    return out


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), value=_json, as_float=st.booleans(), refingerprint=st.booleans())
def test_fuzz_structural_mutations_of_the_header(small, data, value, as_float, refingerprint):
    """Any member replaced by any JSON value, or an integer by the same number as a float (the target fingerprint
    recomputed or not): a checked header or a CorruptPatchError / UnsupportedFormatError, never another exception.
    A header that passes is applied too (few do): the output it promises (a renamed tensor with a recomputed target
    fingerprint is a valid patch of another target) or a luopan error, never another exception."""
    paths = _paths(small.header)
    path = data.draw(st.sampled_from(paths))
    old: Any = small.header
    for p in path:
        old = old[p]
    if as_float and type(old) is int:
        value = float(old)
    header = canonical(small.header_doc(_set(list(path), value), refingerprint))
    try:
        parse_header(header, "fuzz.lpatch")
    except (luopan.CorruptPatchError, luopan.UnsupportedFormatError):
        return
    path = os.path.join(small.root, "fuzz-header.lpatch")
    with open(path, "wb") as f:
        f.write(small.rebuild(header=header))
    out = os.path.join(small.root, "fuzz-header.st")
    try:
        luopan.patch.apply(path, small.base, out)
    except LuopanError:
        assert not os.path.exists(out)
    else:  # the output is what the (mutated, unsigned) header promises: checked against its target fingerprint
        promised = luopan.patch.read_header(path)
        assert luopan.patch.fingerprint_file(out, promised["chunk_size"]) == promised["target_fingerprint"]
        if not refingerprint:  # the original target fingerprint admits only the original target
            got, want = load_file(out), load_file(small.target)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        os.unlink(out)

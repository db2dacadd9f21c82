"""The bytegroup float codec and compression="auto" (docs/format.md §3, §6.1): exact round trips, strict decoding of
damaged blobs, the per-chunk choice, repository defaults and format versions, and end-to-end saves."""

import json
import struct
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import luopan
import luopan.format
from luopan.errors import CorruptPackError, UnsupportedFormatError
from luopan.format.config import Compression, RepoConfig
from luopan.format.pack import CODECS, ENGINE2_CODECS
from luopan.format import bytegroup, planes
from luopan.format import codecs as blobcodec
from luopan.format.codecs import decode_blob, encode_blob

torch = pytest.importorskip("torch")

AUTO = Compression.parse("auto")
ALL = list(planes.CODINGS)


def weights(n, dtype, seed=0):
    """Default-init-like weights: uniform in ±1/sqrt(1024), cast to ``dtype``, as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(n).uniform_(-(1024 ** -0.5), 1024 ** -0.5, generator=g).to(dtype)
    return t.view(torch.uint8).numpy().tobytes()


def roundtrip(data, width, codings):
    plain = bytegroup.encode(memoryview(data), width, codings, blobcodec.compressor(3), rotate=False)
    assert plain[2] == 0 and bytes(bytegroup.decode(plain, len(data), "test")) == data  # transform 0
    blob = bytegroup.encode(memoryview(data), width, codings, blobcodec.compressor(3))
    assert blob[2] == bytegroup.ROTATE and bytes(bytegroup.decode(blob, len(data), "test")) == data
    frame = bytearray(b"\xa5" * (len(data) + 16))  # decoded in place into a caller's buffer: exactly its bytes
    out = memoryview(frame)[8 : 8 + len(data)]
    assert bytegroup.decode(blob, len(data), "test", out) is not None
    assert bytes(out) == data and frame[:8] == frame[-8:] == b"\xa5" * 8
    assert bytes(decode_blob("bytegroup", blob, len(data), "test", out)) == data
    return blob


def test_decode_into_a_buffer_of_the_wrong_size_is_refused():
    blob = roundtrip(weights(1000, torch.bfloat16), 2, [planes.DEFLATE, planes.NIBBLES])
    with pytest.raises(ValueError, match="not 2000"):
        bytegroup.decode(blob, 2000, "x", memoryview(bytearray(1999)))


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_xor_delta_chunks_code_their_planes_with_fast_zstd(dtype, width):
    g = torch.Generator().manual_seed(1)
    w = torch.empty(300_000).normal_(0, 0.02, generator=g).to(dtype)
    moved = (w.float() + torch.empty(300_000).normal_(0, 1e-5, generator=g)).to(dtype)
    xor = np.bitwise_xor(w.view(torch.uint8).numpy(), moved.view(torch.uint8).numpy()).tobytes()
    codec, stored = encode_blob(memoryview(xor), AUTO, width, fast=True)
    assert codec == "bytegroup" and stored[2] == 0  # split without the sign rotation
    codings = [struct.unpack_from("<BI", stored, 4 + 5 * j)[0] for j in range(width)]
    assert set(codings) <= {planes.RAW, planes.ZSTD} and planes.ZSTD in codings
    assert bytes(decode_blob(codec, stored, len(xor), "x")) == xor
    slow_codec, slow = encode_blob(memoryview(xor), AUTO, width)
    assert slow_codec == "bytegroup" and len(stored) < 1.25 * len(slow)  # a little larger, never much


# -- round trips ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4),
                                         (torch.float64, 8)])
def test_roundtrip_float_types(dtype, width):
    data = weights(50_000, dtype)
    for coding in ALL:
        roundtrip(data, width, [coding] * width)
    codec, stored = encode_blob(memoryview(data), AUTO, width)
    out = decode_blob(codec, stored, len(data), "x") if codec != "none" else stored
    assert bytes(out) == data


@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 9, 15, 17, 4097, 65_537])
@pytest.mark.parametrize("width", bytegroup.WIDTHS)
def test_roundtrip_odd_and_tiny_lengths(size, width):
    data = np.random.default_rng(size).integers(0, 4, size, dtype=np.uint8).tobytes()
    for coding in ALL:
        roundtrip(data, width, [coding] * width)


def test_roundtrip_incompressible_and_zero():
    noise = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    zeros = bytes(1 << 20)
    for data in (noise, zeros):
        for width in bytegroup.WIDTHS:
            roundtrip(data, width, [planes.DEFLATE] * width)
            roundtrip(data, width, [planes.ZSTD] * width)
    # incompressible planes fall back to raw; auto stores noise as it is and zeros tiny
    blob = bytegroup.encode(noise, 4, [planes.DEFLATE] * 4, blobcodec.compressor(3))
    assert len(blob) == bytegroup.header_size(4) + len(noise)
    assert encode_blob(memoryview(noise), AUTO, 4) == ("none", memoryview(noise))
    codec, stored = encode_blob(memoryview(zeros), AUTO, 4)
    assert codec == "bytegroup" and len(stored) < 1000


def test_layout_by_hand():
    """A blob written from the spec alone (§6.1): transform 0, raw planes of plain bytes, a deflate plane, a tail."""
    m = 100
    data = b"".join(bytes([i, (7 * i) % 256, i % 3, 0x42]) for i in range(m)) + b"\xee\xff"
    plane = [data[j : 4 * m : 4] for j in range(4)]
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    coded = c.compress(plane[3]) + c.flush()
    assert 0 < len(coded) < m
    blob = struct.pack("<BBBB", 1, 4, 0, 0) + b"".join(struct.pack("<BI", planes.RAW, m) for _ in range(3))
    blob += struct.pack("<BI", planes.DEFLATE, len(coded)) + b"".join(plane[:3]) + coded + data[4 * m:]
    assert bytes(decode_blob("bytegroup", blob, len(data), "x")) == data


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=3000), width=st.sampled_from(bytegroup.WIDTHS),
       codings=st.lists(st.sampled_from(ALL), min_size=8, max_size=8))
def test_roundtrip_property(data, width, codings):
    roundtrip(data, width, codings[:width])


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=True), max_size=2000),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_auto_roundtrip_property(values, dtype):
    with np.errstate(over="ignore"):
        data = np.array(values, dtype=np.float32).astype(dtype).tobytes()
    width = np.dtype(dtype).itemsize
    codec, stored = encode_blob(memoryview(data), AUTO, width)
    assert codec in CODECS
    assert bytes(decode_blob(codec, stored, len(data), "x")) == data


# -- the per-chunk choice ----------------------------------------------------------------------------------------------
def test_auto_choice():
    bf16 = weights(1 << 21, torch.bfloat16)
    codec, stored = encode_blob(memoryview(bf16), AUTO, 2)
    assert codec == "bytegroup" and len(stored) < 0.7 * len(bf16)
    # random-normal fp32 would shrink by ~16%: below the threshold, stored raw without compressing
    fp32 = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32).tobytes()
    assert blobcodec.float_codings(memoryview(fp32), 4, 3) is None
    assert encode_blob(memoryview(fp32), AUTO, 4)[0] == "none"
    # bf16 values held as fp32: the two low planes are zero
    up = torch.frombuffer(bytearray(bf16), dtype=torch.bfloat16).float().numpy().tobytes()
    codec, stored = encode_blob(memoryview(up), AUTO, 4)
    assert codec == "bytegroup" and len(stored) < 0.35 * len(up)
    # other chunks: zstd when it pays, else none
    text = b"token ids and other repetitive bytes " * 10_000
    assert encode_blob(memoryview(text), AUTO, 0)[0] == "zstd"
    noise = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    assert encode_blob(memoryview(noise), AUTO, 0)[0] == "none"
    assert encode_blob(memoryview(bf16), Compression.parse("none"), 2)[0] == "none"
    assert encode_blob(memoryview(bf16), Compression.parse("zstd"), 2)[0] == "zstd"
    assert encode_blob(memoryview(b""), AUTO, 2) == ("none", memoryview(b""))


def test_plane_codings_follow_the_data(monkeypatch):
    bf16 = weights(1 << 20, torch.bfloat16)  # the exponents take a few values: nibbles; the mantissas stay raw
    assert blobcodec.float_codings(memoryview(bf16), 2, 3) == [planes.RAW, planes.NIBBLES]
    zeros = bytes(1 << 20)  # repetition: zstd
    assert blobcodec.float_codings(memoryview(zeros), 4, 3) == [planes.ZSTD] * 4
    fp16 = weights(1 << 20, torch.float16)  # exponent and 3 mantissa bits: too many values for nibbles
    assert blobcodec.float_codings(memoryview(fp16), 2, 3) is None  # saves ~19%: below the threshold
    monkeypatch.setattr(blobcodec, "AUTO_MIN_SAVING", 0.0)
    assert blobcodec.float_codings(memoryview(fp16), 2, 3) == [planes.RAW, planes.DEFLATE]


def test_smaller_than_zipnn():
    zipnn = pytest.importorskip("zipnn")
    data = weights(1 << 21, torch.bfloat16)
    codec, stored = encode_blob(memoryview(data), AUTO, 2)
    theirs = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1).compress(bytearray(data))
    assert codec == "bytegroup" and len(stored) <= len(theirs) * 1.002


# -- damaged blobs -----------------------------------------------------------------------------------------------------
def good_blob():
    """fp32 holding bf16 values (two zero planes: zstd; two Huffman planes) and a 3-byte tail: every plane coded."""
    bf16 = torch.frombuffer(bytearray(weights(100_000, torch.bfloat16)), dtype=torch.bfloat16)
    data = bf16.float().numpy().tobytes() + b"\x07\x08\x09"
    codings = [planes.ZSTD, planes.ZSTD, planes.DEFLATE, planes.DEFLATE]
    blob = bytegroup.encode(memoryview(data), 4, codings, blobcodec.compressor(3))
    assert [blob[4 + 5 * j] for j in range(4)] == codings
    return data, bytearray(blob)


def must_fail(blob, size, match="bytegroup"):
    with pytest.raises(CorruptPackError, match=match):
        decode_blob("bytegroup", bytes(blob), size, "run 'r' step 1 entry 'w' chunk 0")


def test_damaged_blob_is_refused():
    data, blob = good_blob()
    n = len(data)
    hs = bytegroup.header_size(4)
    assert bytes(decode_blob("bytegroup", bytes(blob), n, "x")) == data
    for cut in (0, 1, 3, hs - 1, hs, hs + 10, len(blob) - 4, len(blob) - 1):  # truncated
        must_fail(blob[:cut], n)
    must_fail(blob + b"\0", n)
    for offset, value in ((0, 2), (1, 3), (1, 2), (1, 8), (2, 7), (3, 1), (4, 9), (4, planes.RAW)):
        bad = bytearray(blob)  # version, width, transform, reserved, a plane's coding
        bad[offset] = value
        must_fail(bad, n)
    for j in range(4):  # plane lengths that do not add up
        for delta in (1, -1):
            bad = bytearray(blob)
            coding, length = struct.unpack_from("<BI", bad, 4 + 5 * j)
            struct.pack_into("<BI", bad, 4 + 5 * j, coding, length + delta)
            must_fail(bad, n)
    # length moved from one plane to the next: the total adds up, but neither plane decodes to its size
    for j in (0, 2):
        bad = bytearray(blob)
        (c0, l0), (c1, l1) = struct.unpack_from("<BI", bad, 4 + 5 * j), struct.unpack_from("<BI", bad, 9 + 5 * j)
        struct.pack_into("<BI", bad, 4 + 5 * j, c0, l0 + 1)
        struct.pack_into("<BI", bad, 9 + 5 * j, c1, l1 - 1)
        must_fail(bad, n)
    # the planes' order swapped in the header: a zstd plane read as deflate
    bad = bytearray(blob)
    bad[4 + 5], bad[4 + 10] = planes.DEFLATE, planes.ZSTD
    must_fail(bad, n)
    must_fail(blob, n - 1)  # the wrong raw size
    must_fail(blob, n + 4)
    with pytest.raises(CorruptPackError, match="entry 'w' chunk 0"):
        decode_blob("bytegroup", bytes(blob[:-1]), n, "run 'r' step 1 entry 'w' chunk 0")


def test_corrupted_plane_never_returns_wrong_bytes():
    data, blob = good_blob()
    hs = bytegroup.header_size(4)
    rng = np.random.default_rng(0)
    for _ in range(60):
        bad = bytearray(blob)
        pos = int(rng.integers(hs, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = bytes(decode_blob("bytegroup", bytes(bad), len(data), "x"))
        except CorruptPackError:
            continue
        # a flipped bit in a raw region or a Huffman code can decode to other bytes of the right length: the
        # caller's BLAKE3 check catches that; the codec must never return the wrong length
        assert len(out) == len(data)


def test_hostile_sizes_do_not_allocate():
    m = 1000
    head = struct.pack("<BBBB", 1, 2, 1, 0)
    huge = zstandard.ZstdCompressor().compress(bytes(10 << 20))  # declares 10 MiB
    blob = head + struct.pack("<BI", planes.ZSTD, len(huge)) + struct.pack("<BI", planes.RAW, m) + huge
    blob += bytes(m)
    must_fail(blob, 2 * m)
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = bomb.compress(bytes(10 << 20)) + bomb.flush()
    blob = head + struct.pack("<BI", planes.DEFLATE, len(bomb)) + struct.pack("<BI", planes.RAW, m) + bomb
    blob += bytes(m)
    must_fail(blob, 2 * m)
    with pytest.raises(CorruptPackError, match="declares"):
        decode_blob("zstd", huge, 1000, "x")
    with pytest.raises(CorruptPackError):
        decode_blob("zstd", huge + b"junk", 10 << 20, "x")
    with pytest.raises(CorruptPackError, match="unknown codec"):
        decode_blob("lz4", b"abc", 3, "x")


# -- configuration -----------------------------------------------------------------------------------------------------
def test_compression_values():
    assert Compression.parse("auto") == Compression("auto", 3)
    assert Compression.parse("auto:7") == Compression("auto", 7)
    assert Compression.parse("auto").to_json() == {"codec": "auto", "level": 3}
    assert Compression.parse("none").format_version == 1 and Compression.parse("zstd:5").format_version == 1
    assert Compression.parse("auto").format_version == luopan.format.ENGINE2_FORMAT_VERSION
    for bad in ("auto:0", "auto:23", "auto:x", "bytegroup", "none:3", "lz4"):
        with pytest.raises(luopan.ConfigConflictError):
            Compression.parse(bad)
    with pytest.raises(luopan.ConfigConflictError, match="format_version"):
        RepoConfig(compression=Compression("auto"), format_version=4)
    assert ENGINE2_CODECS == {"bytegroup"} and ENGINE2_CODECS <= set(CODECS)


def config_doc(path):
    with open(path / "luopan.json") as f:
        return json.load(f)


def test_new_repositories_default_to_auto(tmp_path):
    repo = luopan.open(tmp_path / "a")
    assert repo.config.compression == Compression("auto", 3)
    assert config_doc(tmp_path / "a")["format_version"] == 8  # entry groups (6), patch segments (7), row maps (8)
    assert config_doc(tmp_path / "a")["compression"] == {"codec": "auto", "level": 3}
    repo.close()
    for value in ("none", "zstd"):
        r = luopan.open(tmp_path / value, compression=value)
        assert config_doc(tmp_path / value)["format_version"] == 1  # older luopan still read it
        r.close()
    # an existing repository keeps its recorded compression when opened without one
    assert luopan.open(tmp_path / "none").config.compression.codec == "none"
    with pytest.raises(luopan.ConfigConflictError, match="compression"):
        luopan.open(tmp_path / "none", compression="auto")


def test_older_reader_refuses_an_auto_repository(tmp_path, monkeypatch):
    luopan.open(tmp_path / "auto").close()
    luopan.open(tmp_path / "none", compression="none").close()
    monkeypatch.setattr(luopan.format, "FORMAT_VERSION", 4)
    with pytest.raises(UnsupportedFormatError, match="newer than this luopan reads"):
        luopan.open(tmp_path / "auto")
    luopan.open(tmp_path / "none").close()


# -- end to end --------------------------------------------------------------------------------------------------------
def model_state():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 512)]
    return {f"{i}.{k}": v.detach().clone() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}


def test_save_load_exact(tmp_path):
    repo = luopan.open(tmp_path / "r")
    model = model_state()
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.items()}
    half = {k: v.to(torch.float16) for k, v in model.items()}
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((333, 17), dtype=np.float32), "f64": rng.standard_normal(1001),
              "zeros": np.zeros((64, 1000), np.float32), "ints": rng.integers(0, 50, 100_000),
              "f16": rng.standard_normal(777).astype(np.float16), "scalar": np.float32(1.5)}
    state = {"bf16": bf16, "fp32": model, "fp16": half, "np": arrays}
    info = repo.save("run", 1, state)
    nbytes = sum(v.nbytes for v in bf16.values())
    assert info.stored_bytes < sum(v.nbytes for d in (bf16, model, half) for v in d.values()) + 2_000_000
    out = repo.load("run", 1)
    for group in ("bf16", "fp32", "fp16"):
        for k, v in state[group].items():
            assert out[group][k].dtype == v.dtype and torch.equal(out[group][k].view(torch.uint8),
                                                                   v.view(torch.uint8)), (group, k)
    for k, v in arrays.items():
        assert np.asarray(out["np"][k]).tobytes() == np.asarray(v).tobytes(), k
    # a bf16 model alone is stored smaller than its bytes
    info = repo.save("bf16", 1, bf16)
    assert info.stored_bytes < 0.75 * nbytes
    assert not repo.verify().problems
    repo.close()


def test_compression_none_stores_raw(tmp_path):
    repo = luopan.open(tmp_path / "r", compression="none")
    bf16 = {k: v.to(torch.bfloat16) for k, v in model_state().items()}
    info = repo.save("run", 1, bf16)
    assert info.stored_bytes >= sum(v.nbytes for v in bf16.values())
    assert "bytegroup" not in json.dumps(repo.manifest("run", 1).doc)
    repo.close()


def test_verify_gc_and_repack_on_a_compressed_repository(tmp_path):
    repo = luopan.open(tmp_path / "r")
    torch.manual_seed(1)
    a, b, c = (torch.randn(512, 512).to(torch.bfloat16) for _ in range(3))
    repo.save("run", 0, {"a": a, "b": b})
    repo.save("run", 1, {"a": a, "c": c})  # shares a: after step 0 goes, step 0's pack is half dead
    repo.delete("run", 0)
    assert not repo.verify().problems
    report = repo.gc(grace=0, repack_below=0.9)
    assert report.repacked_packs == 1 and not report.skipped_repacks  # the bytegroup blob of a was decoded
    assert not repo.verify().problems
    got = repo.load("run", 1)
    assert torch.equal(got["a"].view(torch.uint16), a.view(torch.uint16))
    assert torch.equal(got["c"].view(torch.uint16), c.view(torch.uint16))
    repo.close()


def test_parts_use_the_float_codec(tmp_path):
    repo = luopan.open(tmp_path / "r")
    bf16 = {k: v.to(torch.bfloat16) for k, v in model_state().items()}
    stored = repo.store_entries(list(bf16.items()))
    codecs = {row[5] for e in stored.entries for row in e["chunks"]}
    assert "bytegroup" in codecs
    tree = {"dict": [[k, {"entry": i}] for i, k in enumerate(bf16)]}
    repo.commit_entries("run", 1, stored.entries, tree, written=stored.written)
    doc = repo.manifest("run", 1).doc
    assert doc["format_version"] == 5 and "bytegroup" in json.dumps(doc)
    out = repo.load("run", 1)
    for k, v in bf16.items():
        assert torch.equal(out[k].view(torch.uint16), v.view(torch.uint16))
    repo.close()


def test_parts_store_raw_without_sampling_an_entry_the_codec_did_not_pay_for(tmp_path, monkeypatch):
    """store_entries follows repo.save's rule: an entry every chunk of which was stored raw last time is stored raw
    again without asking the codec (a sample per chunk), except about one save in RECHECK_EVERY."""
    from luopan.repository import chunkwriter

    repo = luopan.open(tmp_path / "r")
    calls = []
    real = chunkwriter.encode_blob
    monkeypatch.setattr(chunkwriter, "encode_blob",
                        lambda view, *a, **k: calls.append(len(view)) or real(view, *a, **k))
    g = torch.Generator().manual_seed(0)
    asked = []
    for step in range(20):
        state = [("w", torch.randn(4096, generator=g)), ("b", torch.full((8192,), float(step), dtype=torch.bfloat16))]
        calls.clear()
        stored = repo.checkpointing.store_entries(state)
        asked.append(len(calls))
        assert {row[5] for row in stored.entries[0]["chunks"]} == {"none"}  # random fp32: raw either way
        assert {row[5] for row in stored.entries[1]["chunks"]} != {"none"}  # a constant: compressed, asked each time
    assert asked[0] == 2 and min(asked) == 1
    assert sum(1 for n in asked[1:] if n == 2) <= 4  # "w" is asked again about one save in 16
    repo.close()

"""Damaged repositories: flipped bytes, truncation, missing files, newer formats (docs/format.md §10 rules 7-9).

Every read verifies hashes and checksums; damage raises a typed error (errors.py) naming what is damaged, and
checkpoints that do not share the damaged file stay loadable. Step 1 and step 2 of the test repository share no
chunk and no pack, so damage done to step 2's files must not affect step 1.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import luopan
from luopan.format import FORMAT_VERSION

NEWER = FORMAT_VERSION + 1  # a format this luopan does not read
from luopan.format.canonical import seal, unseal

from .helpers import assert_same_state

RUN = "corrupt"
CHUNK_SIZE = 64 * 1024
PACK_SIZE = 256 * 1024


def make_state(step):
    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": rng.standard_normal((256, 1024), dtype=np.float32),  # 1 MiB: 16 row-aligned chunks
            "b": np.arange(1000, dtype=np.float64) * (step + 0.5),
        },
        "ids": rng.integers(0, 1 << 60, size=50_000, dtype=np.int64),
        "step": step,
    }


def make_compressible_state(step):
    rng = np.random.default_rng(50 + step)
    return {
        "tokens": rng.integers(0, 40, size=(512, 256), dtype=np.int64),  # 1 MiB of small ints: compresses well
        "mask": (rng.random(300_000) < 0.05),
        "step": step,
    }


def pack_path(root, pack_id):
    return os.path.join(root, "packs", pack_id[:2], pack_id + ".pack")


def manifest_path(root, step):
    return os.path.join(root, "runs", RUN, "ckpt", f"{step:08d}.json")


def flip(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        assert len(b) == 1, f"offset {offset} is past the end of {path}"
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def chunk_of(repo, step, entry, index):
    """(pack id, offset, stored length, raw size, codec) of chunk ``index`` of ``entry`` in checkpoint ``step``."""
    m = repo.manifest(RUN, step)
    h, p, off, length, size, codec, _x = m.entry(entry)["chunks"][index]
    return m.packs[p], off, length, size, codec


def names_chunk(msg, step, entry, index):
    return (f"'{RUN}'" in msg and re.search(rf"\bstep {step}\b", msg) and f"'{entry}'" in msg
            and re.search(rf"\bchunk {index}\b", msg))


def assert_other_checkpoint_intact(root, step=1, state_fn=make_state):
    repo = luopan.open(root)
    report = repo.verify(RUN, step)
    assert report.ok and report.checkpoints == 1
    assert_same_state(repo.load(RUN, step), state_fn(step))
    repo.close()


@pytest.fixture
def two_steps(tmp_path):
    """A repository with steps 1 and 2 of RUN that share no pack (manifests as plain sealed JSON: the tests below
    damage it byte by byte; compressed manifests are covered by test_damaged_compressed_manifest_is_corrupt)."""
    root = str(tmp_path / "repo")
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE, compression="none")
    repo.save(RUN, 1, make_state(1))
    repo.save(RUN, 2, make_state(2))
    m1, m2 = repo.manifest(RUN, 1), repo.manifest(RUN, 2)
    assert not set(m1.packs) & set(m2.packs) and len(m2.packs) >= 3
    assert len(m2.entry("model/w")["chunks"]) == 16
    repo.close()
    return root


# -- packs ---------------------------------------------------------------------------------------------------------

def test_flipped_byte_in_chunk_is_caught_on_load_and_verify(two_steps):
    root = two_steps
    repo = luopan.open(root)
    pack, off, length, size, codec = chunk_of(repo, 2, "model/w", 5)
    assert codec == "none"
    flip(pack_path(root, pack), off + length // 2)

    with pytest.raises(luopan.IntegrityError, match=r"hash mismatch") as ei:
        repo.load(RUN, 2)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, luopan.LuopanError)
    assert names_chunk(str(ei.value), 2, "model/w", 5), str(ei.value)
    with pytest.raises(luopan.IntegrityError):
        repo.load(RUN)  # latest is step 2

    with pytest.raises(luopan.IntegrityError, match=r"1 problem") as ei:
        repo.verify(RUN, 2)
    problems = ei.value.problems
    assert len(problems) == 1 and isinstance(problems[0], luopan.IntegrityError)
    assert names_chunk(str(problems[0]), 2, "model/w", 5), str(problems[0])
    assert "model/w" in str(ei.value)

    with pytest.raises(luopan.IntegrityError) as ei:  # whole repository: the same single problem
        repo.verify()
    assert len(ei.value.problems) == 1 and names_chunk(str(ei.value.problems[0]), 2, "model/w", 5)

    # load_into never copies the damaged chunk into the target
    target = make_state(1)
    before = target["model"]["w"].copy()
    with pytest.raises(luopan.IntegrityError, match="model/w"):
        repo.load_into(RUN, target, step=2)
    rows = slice(5 * 16, 6 * 16)  # chunk 5 = rows 80..95 (16 rows of 4 KiB per 64 KiB chunk)
    assert target["model"]["w"][rows].tobytes() == before[rows].tobytes()
    repo.close()

    assert_other_checkpoint_intact(root)


@pytest.mark.parametrize("where", ["mid-chunk", "chunk-start", "empty"])
def test_truncated_pack_raises_corrupt_pack_error(two_steps, where):
    root = two_steps
    repo = luopan.open(root)
    pack, off, length, _size, _codec = chunk_of(repo, 2, "model/w", 5)
    truncate(pack_path(root, pack), {"mid-chunk": off + 100, "chunk-start": off, "empty": 0}[where])
    # chunks of model/w in the same pack before chunk 5 (if any) are still complete
    first_bad = 5 if where != "empty" else min(
        i for i in range(16) if chunk_of(repo, 2, "model/w", i)[0] == pack)

    with pytest.raises(luopan.CorruptPackError, match="truncated") as ei:
        repo.load(RUN, 2)
    assert isinstance(ei.value, luopan.IntegrityError) and isinstance(ei.value, ValueError)
    assert names_chunk(str(ei.value), 2, "model/w", first_bad), str(ei.value)

    with pytest.raises(luopan.IntegrityError) as ei:
        repo.verify(RUN, 2)
    problems = ei.value.problems
    assert problems and all(isinstance(p, luopan.CorruptPackError) for p in problems)
    assert any(names_chunk(str(p), 2, "model/w", first_bad) for p in problems)
    # every problem is a chunk of the truncated pack
    assert all(pack[:16] in str(p) for p in problems)
    repo.close()

    assert_other_checkpoint_intact(root)


def test_missing_pack_raises_missing_pack_error(two_steps):
    root = two_steps
    repo = luopan.open(root)
    pack, *_ = chunk_of(repo, 2, "model/w", 5)
    os.unlink(pack_path(root, pack))

    with pytest.raises(luopan.MissingPackError, match=re.escape(f"packs/{pack[:2]}/{pack}.pack")) as ei:
        repo.load(RUN, 2)
    assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, luopan.IntegrityError)
    assert f"'{RUN}'" in str(ei.value) and "step 2" in str(ei.value) and "'model/w'" in str(ei.value)

    with pytest.raises(luopan.IntegrityError) as ei:
        repo.verify(RUN, 2)
    problems = ei.value.problems
    assert problems and all(isinstance(p, luopan.MissingPackError) for p in problems)
    assert any(names_chunk(str(p), 2, "model/w", 5) for p in problems)
    repo.close()

    assert_other_checkpoint_intact(root)


# -- manifests -----------------------------------------------------------------------------------------------------

def _middle_of_a_hash(data: bytes) -> int:
    m = re.search(rb'"chunks":\[\["([0-9a-f]{64})"', data)
    assert m
    return m.start(1) + 30


@pytest.mark.parametrize("where", ["first-byte", "inside-a-chunk-hash", "last-byte", "non-utf8"])
def test_flipped_byte_in_manifest_raises_corrupt_manifest_error(two_steps, where):
    root = two_steps
    path = manifest_path(root, 2)
    with open(path, "rb") as f:
        data = f.read()
    offset = {"first-byte": 0, "inside-a-chunk-hash": _middle_of_a_hash(data), "last-byte": len(data) - 1,
              "non-utf8": _middle_of_a_hash(data)}[where]
    flip(path, offset, 0x80 if where == "non-utf8" else 0x01)
    _assert_manifest_2_damaged(root)


@pytest.mark.parametrize("damage", ["first-byte", "middle", "last-byte", "truncated", "frame-claims-1GiB-more"])
def test_damaged_compressed_manifest_is_corrupt(tmp_path, damage):
    """Repositories of format_version 5 store checkpoint manifests as a zstd frame of the sealed JSON (§4)."""
    root = str(tmp_path / "repo")
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE, compression="auto")
    repo.save(RUN, 1, make_state(1))
    repo.save(RUN, 2, make_state(2))
    repo.close()
    path = manifest_path(root, 2)
    data = open(path, "rb").read()
    assert data[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
    if damage == "truncated":
        truncate(path, len(data) // 2)
    elif damage == "frame-claims-1GiB-more":
        import zstandard

        c, mib = zstandard.ZstdCompressor().compressobj(), b" " * (1 << 20)
        bomb = b"".join(c.compress(mib) for _ in range(1025)) + c.flush()  # ~100 KiB that inflate past 1 GiB
        with open(path, "wb") as f:
            f.write(bomb)
    else:
        flip(path, {"first-byte": 5, "middle": len(data) // 2, "last-byte": len(data) - 1}[damage])
    _assert_manifest_2_damaged(root)


@pytest.mark.parametrize("size", [0, 1, "half", "minus-one"])
def test_truncated_manifest_raises_corrupt_manifest_error(two_steps, size):
    root = two_steps
    path = manifest_path(root, 2)
    full = os.path.getsize(path)
    truncate(path, {"half": full // 2, "minus-one": full - 1}.get(size, size))
    _assert_manifest_2_damaged(root)


def _assert_manifest_2_damaged(root, match="damaged"):
    name = re.escape(f"runs/{RUN}/ckpt/00000002.json")
    repo = luopan.open(root)
    assert repo.steps(RUN) == [1, 2]  # listing does not parse; reading does
    with pytest.raises(luopan.CorruptManifestError, match=name) as ei:
        repo.load(RUN, 2)
    assert re.search(match, str(ei.value)), str(ei.value)
    assert isinstance(ei.value, luopan.IntegrityError) and isinstance(ei.value, ValueError)
    with pytest.raises(luopan.CorruptManifestError, match=name):
        repo.load(RUN)  # the latest is step 2: no silent fallback to step 1
    with pytest.raises(luopan.CorruptManifestError, match=name):
        repo.checkpoints(RUN)
    with pytest.raises(luopan.IntegrityError) as ei:
        repo.verify(RUN)
    problems = ei.value.problems
    assert len(problems) == 1 and isinstance(problems[0], luopan.CorruptManifestError)
    assert re.search(name, str(problems[0]))
    assert ei.value.report.checkpoints == 2
    repo.close()
    assert_other_checkpoint_intact(root)


def _reseal_manifest(root, step, edit):
    path = manifest_path(root, step)
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    edit(doc)
    with open(path, "wb") as f:
        f.write(seal(doc))


def test_properly_sealed_manifest_failing_the_schema_is_corrupt(two_steps):
    def edit(doc):
        doc["entries"][0]["chunks"][0][2] = -16  # negative offset
    _reseal_manifest(two_steps, 2, edit)
    _assert_manifest_2_damaged(two_steps, match="schema")


def test_properly_sealed_manifest_with_inconsistent_sizes_is_corrupt(two_steps):
    def edit(doc):
        doc["entries"][0]["nbytes"] += 1
    _reseal_manifest(two_steps, 2, edit)
    _assert_manifest_2_damaged(two_steps, match="is not 1048577 bytes")


def _grow_shape(doc):
    doc["entries"][0]["shape"][0] *= 16  # claims more elements than its chunks hold: must never load garbage


def _shrink_shape(doc):
    doc["entries"][0]["shape"][0] //= 2


def _object_dtype(doc):
    doc["entries"][0]["kind"] = "numpy"
    doc["entries"][0]["dtype"] = "object"


def _torch_attr_dtype(doc):
    doc["entries"][0]["kind"] = "torch"
    doc["entries"][0]["dtype"] = "load"  # a torch module attribute, not a dtype


def _wider_dtype(doc):
    doc["entries"][0]["dtype"] = "float64"


def _huge_chunk(doc):
    doc["entries"][0]["chunks"][0][4] = 10**12
    doc["entries"][0]["chunks"][0][3] = 10**12


def _stored_length_differs(doc):
    doc["entries"][0]["chunks"][0][3] -= 1


def _mismatched_alias(doc):
    doc["entries"].append(dict(doc["entries"][1], alias_of=0))
    doc["entries"][-1].pop("chunks")
    doc["entries"][-1].pop("chunking")
    doc["entries"][-1]["path"] = "model/alias"
    doc["tree"]["dict"][0][1]["dict"].append(["alias", {"entry": len(doc["entries"]) - 1}])


@pytest.mark.parametrize("edit, match", [
    (_grow_shape, "is not .* bytes"),
    (_shrink_shape, "is not .* bytes"),
    (_object_dtype, "unsupported numpy dtype 'object'"),
    (_torch_attr_dtype, "unsupported torch dtype 'load'"),
    (_wider_dtype, "is not .* bytes"),
    (_huge_chunk, "impossible size"),
    (_stored_length_differs, "impossible size"),
    (_mismatched_alias, "different type or shape"),
])
def test_hostile_but_properly_sealed_manifests_are_refused(two_steps, edit, match):
    """A manifest that passes its checksum can still lie; every lie that would reach memory is refused."""
    _reseal_manifest(two_steps, 2, edit)
    _assert_manifest_2_damaged(two_steps, match=match)


def test_manifest_at_the_wrong_location_is_corrupt(two_steps):
    root = two_steps
    with open(manifest_path(root, 1), "rb") as f:
        data = f.read()
    with open(manifest_path(root, 2), "wb") as f:  # step 1's manifest (valid, sealed) under step 2's name
        f.write(data)
    _assert_manifest_2_damaged(root, match="not its location")


def test_manifest_with_newer_format_version_is_refused(two_steps):
    root = two_steps

    def edit(doc):
        doc["format_version"] = NEWER
    _reseal_manifest(root, 2, edit)
    # only the version differs from a valid manifest
    with open(manifest_path(root, 2), "rb") as f:
        assert unseal(f.read())["format_version"] == NEWER  # checksum valid: not damage

    repo = luopan.open(root)
    name = re.escape(f"runs/{RUN}/ckpt/00000002.json")
    for load in (lambda: repo.load(RUN, 2), lambda: repo.load(RUN), lambda: repo.manifest(RUN, 2)):
        with pytest.raises(luopan.UnsupportedFormatError, match=rf"format_version {NEWER}\b.*\({FORMAT_VERSION}\).*upgrade luopan") as ei:
            load()
        assert re.search(name, str(ei.value))
        assert isinstance(ei.value, RuntimeError) and isinstance(ei.value, luopan.LuopanError)
        assert not isinstance(ei.value, luopan.IntegrityError)  # not damage: a newer writer
    # verify refuses it too (raised directly, or reported as a problem)
    try:
        repo.verify(RUN)
    except luopan.UnsupportedFormatError as exc:
        assert "upgrade" in str(exc)
    except luopan.IntegrityError as exc:
        assert any(f"format_version {NEWER}" in str(p) and "upgrade" in str(p) for p in exc.problems), exc.problems
    else:
        pytest.fail("verify accepted a manifest with a newer format_version")
    repo.close()
    assert_other_checkpoint_intact(root)


# -- repository config ---------------------------------------------------------------------------------------------

def test_repo_config_with_newer_format_version_is_refused(two_steps):
    root = two_steps
    cfg = os.path.join(root, "luopan.json")
    with open(cfg, "rb") as f:
        original = f.read()
    doc = json.loads(original)
    doc["format_version"] = NEWER
    with open(cfg, "wb") as f:
        f.write(seal(doc))

    for kwargs in ({}, {"create": False}):
        with pytest.raises(luopan.UnsupportedFormatError, match=rf"format_version {NEWER}\b.*\({FORMAT_VERSION}\).*upgrade luopan") as ei:
            luopan.open(root, **kwargs)
        assert isinstance(ei.value, RuntimeError)
        assert root in str(ei.value)
    with open(cfg, "rb") as f:
        assert f.read() == seal(doc)  # refusing never rewrites the newer config

    with open(cfg, "wb") as f:
        f.write(original)
    assert_other_checkpoint_intact(root, 1)
    assert_other_checkpoint_intact(root, 2)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_repo_config_raises_corrupt_repo_error(two_steps, damage):
    root = two_steps
    cfg = os.path.join(root, "luopan.json")
    with open(cfg, "rb") as f:
        original = f.read()
    if damage == "flip":
        flip(cfg, original.index(b'"repo_id":"') + 15)
    else:
        truncate(cfg, len(original) // 2)
    with pytest.raises(luopan.CorruptRepoError, match="config") as ei:
        luopan.open(root)
    assert isinstance(ei.value, luopan.IntegrityError)
    with open(cfg, "rb") as f:
        assert f.read() != original  # not silently "repaired" by overwriting
    with open(cfg, "wb") as f:
        f.write(original)
    assert_other_checkpoint_intact(root, 1)
    assert_other_checkpoint_intact(root, 2)


# -- compressed repositories ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["frame-start", "middle", "last-byte"])
def test_flipped_byte_in_compressed_blob_is_caught(tmp_path, where):
    root = str(tmp_path / "zrepo")
    repo = luopan.open(root, compression="zstd", chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    repo.save(RUN, 1, make_compressible_state(1))
    info = repo.save(RUN, 2, make_compressible_state(2))
    assert info.stored_bytes < info.logical_bytes / 2  # really compressed
    m1, m2 = repo.manifest(RUN, 1), repo.manifest(RUN, 2)
    assert not set(m1.packs) & set(m2.packs)
    pack, off, length, size, codec = chunk_of(repo, 2, "tokens", 3)
    assert codec == "zstd" and length < size

    flip(pack_path(root, pack), off + {"frame-start": 0, "middle": length // 2, "last-byte": length - 1}[where])

    with pytest.raises(luopan.IntegrityError) as ei:
        repo.load(RUN, 2)
    assert names_chunk(str(ei.value), 2, "tokens", 3), str(ei.value)
    with pytest.raises(luopan.IntegrityError) as ei:
        repo.verify(RUN, 2)
    assert len(ei.value.problems) == 1 and names_chunk(str(ei.value.problems[0]), 2, "tokens", 3)
    repo.close()

    assert_other_checkpoint_intact(root, 1, make_compressible_state)

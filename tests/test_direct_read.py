"""Loads read each chunk into the memory it ends in (issue 29): fresh tensors in huge-page arenas
(luopan.checkpoint.destinations), each with its own storage, every chunk still verified there."""

from __future__ import annotations

import gc
import io
import os
import weakref

import numpy as np
import pytest
import torch

import luopan
from luopan.format.manifest import Row
from luopan.checkpoint.destinations import ALIGN, ARENA_BYTES, fresh_arrays

from .helpers import assert_exact


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB
        "b": torch.randn(1024, generator=g),
        "h": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "i": torch.arange(10, dtype=torch.int64),
        "m": torch.rand(1000, generator=g) < 0.5,
        "c": torch.randn(5, 3, dtype=torch.complex64, generator=g),
        "s": torch.tensor(3.5),
        "e": torch.zeros(0, 4),
        "n": {"a": np.arange(12, dtype=np.float16).reshape(3, 4), "z": np.zeros((2, 0)), "u": np.uint8(7)},
        "step": 3,
    }


def test_fresh_tensors_have_their_own_exact_storage(tmp_path):
    repo = luopan.open(tmp_path / "r")
    state = _state()
    repo.save("run", 0, state)
    got = repo.load("run", 0)
    assert_exact(got, state)
    for key in ("w", "b", "h", "i", "m", "c", "s"):
        t = got[key]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), key
        assert t.is_contiguous() and t.storage_offset() == 0 and not t.requires_grad
    buf = io.BytesIO()
    torch.save(got["b"], buf)  # only its own 4 KiB, not the arena around it
    assert len(buf.getvalue()) < 8192
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert torch.equal(loaded, state["b"])
    got["b"].add_(1)  # writable, and no other tensor shares its bytes
    assert_exact({k: got[k] for k in ("w", "h", "i")}, {k: state[k] for k in ("w", "h", "i")})
    assert got["n"]["a"].flags.writeable and got["n"]["a"].flags.c_contiguous
    got["n"]["a"][0, 0] = 9
    assert isinstance(got["n"]["u"], np.uint8) and got["n"]["u"] == 7


def test_load_entry_and_tied_weights(tmp_path):
    repo = luopan.open(tmp_path / "r")
    w = torch.randn(64, 64)
    repo.save("run", 0, {"a": w, "tied": w, "x": torch.ones(3)})
    got = repo.load("run", 0)
    assert got["a"] is got["tied"] and torch.equal(got["a"], w)
    m = repo.manifest("run", 0)
    i = next(k for k, e in enumerate(m.entries) if e["path"] == "x")
    assert torch.equal(repo.checkpointing.load_entry(m, i), torch.ones(3))


def test_arenas_group_entries_in_order_and_align_them():
    mib = 1 << 20
    specs = [("numpy", "uint8", [3]), ("numpy", "float32", [mib // 4]), ("torch", "float32", [ARENA_BYTES // 4 + 1]),
             ("numpy", "uint8", [ARENA_BYTES - 2 * mib]), ("numpy", "uint8", [2 * mib]), ("torch", "int8", [5])]
    out = fresh_arrays(specs)
    arena = [id(view.obj) for _obj, view in out]  # the allocation each entry's memory is cut from
    addr = [np.frombuffer(view, np.uint8).ctypes.data for _obj, view in out]
    assert arena[1] == arena[0] and addr[1] == addr[0] + ALIGN  # the next entry, on the next cache line
    assert len({arena[0], arena[2], arena[3]}) == 3  # too large to share one / too large to join the first
    assert arena[4] == arena[3] and addr[4] == addr[3] + ARENA_BYTES - 2 * mib  # exactly fills it
    assert len({arena[0], arena[2], arena[3], arena[5]}) == 4
    assert [len(v) for _o, v in out] == [3, mib, ARENA_BYTES + 4, ARENA_BYTES - 2 * mib, 2 * mib, 5]
    for (obj, view), (kind, _dtype, shape) in zip(out, specs):
        assert list(obj.shape) == shape and (kind == "torch") == isinstance(obj, torch.Tensor)
        view[:1] = b"\x05"  # writable views of the objects' memory
        assert (obj.reshape(-1)[:1].view(torch.uint8) if kind == "torch" else obj.reshape(-1).view(np.uint8))[0] == 5


def test_an_arena_is_freed_with_its_last_tensor():
    out = fresh_arrays([("torch", "float32", [1000]), ("numpy", "int64", [10])])
    arena = weakref.ref(out[0][1].obj)  # the allocation the entries' memory is cut from
    assert out[1][1].obj is arena()
    tensor, array = out[0][0], out[1][0]
    del out
    gc.collect()
    assert arena() is not None
    del tensor
    gc.collect()
    assert arena() is not None  # the array still lives in it
    del array
    gc.collect()
    assert arena() is None


@pytest.mark.parametrize("compression", ["zstd", "auto", "none"])
def test_compressed_chunks_load_and_load_into(tmp_path, compression):
    repo = luopan.open(tmp_path / "r", compression=compression)
    g = torch.Generator().manual_seed(1)
    state = {"bf": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16),  # bytegroup under "auto"
             "ids": torch.arange(300_000, dtype=torch.int64) % 7, "f": torch.randn(1000, generator=g)}
    repo.save("run", 0, state)
    codecs = {Row._make(c).codec for e in repo.manifest("run", 0).entries for c in e.get("chunks", [])}
    if compression != "none":
        assert codecs - {"none"}, codecs
    assert_exact(repo.load("run", 0), state)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    repo.load_into("run", target=target)
    assert_exact(target, state)


def test_many_small_chunks_in_groups_and_a_damaged_one_named(tmp_path):
    root = tmp_path / "r"
    repo = luopan.open(root, compression="none")
    state = {f"b{i:03d}": torch.full((100,), float(i)) for i in range(300)}
    repo.save("run", 0, state)
    assert_exact(repo.load("run", 0), state)
    m = repo.manifest("run", 0)
    e = next(e for e in m.entries if e["path"] == "b150")
    row = Row._make(e["chunks"][0])
    assert row.codec == "none"
    pack = m.packs[row.pack]
    with open(os.path.join(root, "packs", pack[:2], pack + ".pack"), "r+b") as f:
        f.seek(row.offset + row.length // 2)
        byte = f.read(1)
        f.seek(row.offset + row.length // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(luopan.IntegrityError, match=r"hash mismatch.*b150"):
        repo.load("run", 0)
    target = {k: torch.zeros(100) for k in state}
    with pytest.raises(luopan.IntegrityError, match=r"b150"):
        repo.load_into("run", target=target)
    assert not target["b150"].any()  # verified before it is written into memory the caller owns

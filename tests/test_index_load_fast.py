"""An IVF load fills its inverted lists while they are sized on a second thread (luopan.index.fill): the lists come
back byte for byte whether a chunk spans many lists or lies in one, over several segments, and a damaged chunk or a
failed sizing is raised (never a hang, never a half-filled index handed back)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import luopan
from luopan.errors import IntegrityError

faiss = pytest.importorskip("faiss")

D = 16


def lists_of(index):
    il = faiss.extract_index_ivf(index).invlists
    out = []
    for i in range(il.nlist):
        n = il.list_size(i)
        codes = faiss.rev_swig_ptr(il.get_codes(i), n * il.code_size).copy() if n else b""
        ids = faiss.rev_swig_ptr(il.get_ids(i), n).copy() if n else []
        out.append((bytes(codes), list(ids)))
    return out


def grown(repo, name, chunk_size):
    rng = np.random.default_rng(3)
    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(D), D, 8)
    x = rng.standard_normal((3000, D)).astype("float32")
    index.train(x)
    index.add(x)
    idx = luopan.index.IndexStore(repo, name)
    idx.snapshot(index)
    index.add(rng.standard_normal((600, D)).astype("float32"))  # a second segment: every list's tail
    idx.snapshot(index)
    return idx, index


@pytest.mark.parametrize("chunk_size", [4096, 1 << 20])  # chunks within one list and across many; one per segment
def test_lists_come_back_byte_for_byte(tmp_path, chunk_size):
    repo = luopan.open(tmp_path / "repo", chunk_size=chunk_size)
    idx, index = grown(repo, "kb", chunk_size)
    doc = idx.manifest()
    assert any(e["path"] == "ivf/1/codes" for e in doc["entries"])  # two segments
    got = idx.load()
    assert got.ntotal == index.ntotal and lists_of(got) == lists_of(index)
    q = np.random.default_rng(4).standard_normal((20, D)).astype("float32")
    assert all(np.array_equal(a, b) for a, b in zip(got.search(q, 5), index.search(q, 5)))
    repo.close()


def test_a_damaged_segment_chunk_is_an_integrity_error(tmp_path):
    repo = luopan.open(tmp_path / "repo", chunk_size=4096)
    idx, _index = grown(repo, "kb", 4096)
    doc = idx.manifest()
    row = next(e for e in doc["entries"] if e["path"] == "ivf/0/codes")["chunks"][3]
    pack = doc["packs"][row[1]]
    path = next(os.path.join(d, f) for d, _s, fs in os.walk(tmp_path / "repo" / "packs") for f in fs if f.startswith(pack))
    with open(path, "r+b") as f:
        f.seek(row[2] + 10)
        byte = f.read(1)
        f.seek(row[2] + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        idx.load()
    repo.close()


def test_a_failed_sizing_is_raised_not_waited_for(tmp_path, monkeypatch):
    from luopan.index import faiss_codec

    repo = luopan.open(tmp_path / "repo", chunk_size=4096)
    idx, _index = grown(repo, "kb", 4096)
    real = faiss_codec.Unsized.size

    def size(self, i, n):
        if i == 5:
            raise MemoryError("no memory for list 5")
        return real(self, i, n)

    monkeypatch.setattr(faiss_codec.Unsized, "size", size)
    with pytest.raises(MemoryError, match="list 5"):
        idx.load()
    repo.close()

"""PackWriter: when packs are closed and written (docs/format.md §6)."""

import os

import luopan
from luopan.repository.packwriter import EARLY_FLUSH_MIN, PackWriter
from luopan.store.local import LocalStore

MIB = 1 << 20


def _add(writer, n, raw, stored):
    for k in range(n):
        writer.add(f"{k:064x}", memoryview(bytes([k % 251]) * stored), raw, "zstd")


def test_a_pack_of_compressed_chunks_is_written_once_it_holds_pack_size_of_raw_bytes(tmp_path):
    w = PackWriter(LocalStore(str(tmp_path)), 16 * MIB)
    try:
        _add(w, 4, 4 * MIB, 3 * MIB)  # 16 MiB raw, 12 MiB stored (>= EARLY_FLUSH_MIN): written now
        assert len(w.written) == 1 and not w.builder.blobs
        _add(w, 4, 4 * MIB, MIB)  # 16 MiB raw, 4 MiB stored: too small a pack, kept open
        assert len(w.written) == 1 and w.builder.blobs
        _add(w, 4, 4 * MIB, MIB)  # now 8 MiB stored: written
        assert len(w.written) == 2 and not w.builder.blobs
        w.finish()
    finally:
        w.close()
    assert 4 * MIB < EARLY_FLUSH_MIN <= 8 * MIB


def test_uncompressed_packs_still_fill_to_pack_size(tmp_path):
    w = PackWriter(LocalStore(str(tmp_path)), 16 * MIB)
    try:
        _add(w, 3, 4 * MIB, 4 * MIB)
        assert not w.written
        _add(w, 1, 4 * MIB, 4 * MIB)
        assert len(w.written) == 1
        w.finish()
    finally:
        w.close()


def test_a_compressed_save_writes_several_packs_and_loads_back(tmp_path):
    import numpy as np

    repo = luopan.open(tmp_path / "r", compression="zstd", pack_size=32 * MIB, chunk_size=4 * MIB)
    state = {"x": np.tile(np.arange(1024, dtype=np.float32), 16 * 1024)}  # 64 MiB that zstd shrinks to nothing
    state["y"] = np.random.default_rng(0).integers(0, 7, 48 * MIB, dtype=np.uint8)  # 48 MiB, ~40% of it stored
    repo.save("run", 1, state)
    packs = [f for _d, _s, files in os.walk(tmp_path / "r" / "packs") for f in files]
    new_packs = repo.manifest("run", 1).doc["stats"]["new_packs"]
    assert len(packs) == new_packs >= 2  # without early flushes: one (~20 MiB < pack_size)
    got = repo.load("run", 1)
    assert all(np.array_equal(got[k], v) for k, v in state.items())

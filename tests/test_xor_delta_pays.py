"""XOR deltas only where they pay (issue 31, docs/format.md §5.4): an XOR delta must at least halve an entry to be
worth its CPU time. A full fp32 fine-tune moves every weight by about the learning rate, so the XOR of two versions
keeps two noise bytes of four (~0.55 of the entry): its weights are stored plainly, as fast as without deltas. A
bf16 fine-tune's small updates, and fp32 weights of which only a few move, still become XOR deltas. Content whose
delta does not pay (an optimizer's moments) is not read back at every save to ask again. Every save loads back bit
for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import luopan
from luopan.store.local import LocalStore

N = 4  # saves after the first


class CountingStore(LocalStore):
    """A local store that counts the reads of pack bytes (what a save reads back to XOR with, or to sample)."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.pack_reads = 0

    def read_into(self, key, offset, out):
        if key.startswith("packs/"):
            self.pack_reads += 1
        return super().read_into(key, offset, out)


def weights(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": (torch.randn(512, 1024, generator=g) * 0.02).to(dtype) for i in range(3)}


def fp32_step(state, seed):
    """An AdamW-sized update of every fp32 weight: about lr = 1e-5 each (the magnitudes differ per element)."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        t.add_(torch.randn(t.shape, generator=g) * 1e-5)


def bf16_step(state, seed):
    """A bf16 fine-tune's step: most weights move by up to one ulp."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        t.add_((torch.randn(t.shape, generator=g) * 1e-4).to(torch.bfloat16))


def few_step(state, seed):
    """fp32 weights of which one in 16 moves (the rest frozen, or below the update's reach)."""
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        flat = t.view(-1)
        flat[::16] += torch.randn(flat[::16].shape, generator=g) * 1e-3


def save_run(tmp_path, state, step_fn, name="r"):
    """Save the initial state and N steps of ``step_fn``; returns (repo, store, saved states, stored bytes, pack
    reads of each save)."""
    store = CountingStore(tmp_path / name)
    repo = luopan.open(store, chunk_size=256 << 10, progress=False)
    saved, stored, reads = [], [], []
    for step in range(N + 1):
        if step:
            step_fn(state, step)
        before = store.pack_reads
        stored.append(repo.save("ft", step, state).stored_bytes)
        reads.append(store.pack_reads - before)
        saved.append({k: v.clone() for k, v in state.items()})
    return repo, store, saved, stored, reads


def xor_entries(repo, step):
    return sum("xor" in e for e in repo.manifest("ft", step).doc["entries"])


def assert_loads_exactly(path, saved):
    fresh = luopan.open(path, progress=False)
    for step, want in enumerate(saved):
        got = fresh.load("ft", step)
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), (step, k)
    assert fresh.verify().ok


def test_a_full_fp32_fine_tune_is_stored_plainly(tmp_path):
    state = weights()
    nbytes = sum(t.nbytes for t in state.values())
    repo, _store, saved, stored, reads = save_run(tmp_path, state, fp32_step)
    assert [xor_entries(repo, s) for s in range(N + 1)] == [0] * (N + 1)  # before: XOR deltas from save 1 on
    assert all(b >= 0.95 * nbytes for b in stored)  # no delta pays for fp32 moved by ~lr: the weights, raw
    assert reads[2] == reads[4] == 0  # the sample said no at saves 1 and 3: XOR deltas paused, nothing read back
    assert_loads_exactly(tmp_path / "r", saved)


def test_a_bf16_fine_tune_and_a_few_moved_fp32_weights_keep_xor_deltas(tmp_path):
    for name, dtype, step_fn in (("bf16", torch.bfloat16, bf16_step), ("few", torch.float32, few_step)):
        state = weights(dtype, seed=1)
        nbytes = sum(t.nbytes for t in state.values())
        repo, _store, saved, stored, _reads = save_run(tmp_path, state, step_fn, name)
        assert [xor_entries(repo, s) for s in range(N + 1)] == [0] + [3] * N, name
        assert sum(stored[1:]) <= 0.5 * N * nbytes, name  # each delta at least halves the entry
        assert_loads_exactly(tmp_path / name, saved)


def test_content_whose_delta_does_not_pay_is_not_read_back_at_every_save(tmp_path):
    """An optimizer's moments: new values at every save, whose XOR with the last version is noise. The sample that
    says so pauses XOR deltas for the entry (1, 2, 4, ... saves), as a delta that did not pay does."""
    rng = np.random.default_rng(0)
    store = CountingStore(tmp_path / "r")
    repo = luopan.open(store, chunk_size=256 << 10, progress=False)
    reads, saved = [], []
    for step in range(7):
        state = {"exp_avg": rng.standard_normal((512, 1024), dtype=np.float32) * 1e-3}
        before = store.pack_reads
        repo.save("opt", step, state)
        reads.append(store.pack_reads - before)
        saved.append(state)
        assert "xor" not in repo.manifest("opt", step).entry("exp_avg")
    # sampled at saves 1, 3 and 6 (one chunk read back each time); paused at 2, 4 and 5 (before: read at every save)
    assert [r > 0 for r in reads] == [False, True, False, True, False, False, True], reads
    fresh = luopan.open(tmp_path / "r", progress=False)
    for step, want in enumerate(saved):
        assert np.array_equal(fresh.load("opt", step)["exp_avg"].view(np.uint32), want["exp_avg"].view(np.uint32))


@pytest.mark.parametrize("fraction", [0.5, 0.7])
def test_xor_fraction_decides_for_fp32(tmp_path, fraction):
    """The threshold is the policy's: a user who takes ~0.55 of the bytes for the CPU can ask for it."""
    state = weights(seed=2)
    repo = luopan.open(tmp_path / "r", chunk_size=256 << 10, progress=False,
                       delta_policy=luopan.DeltaPolicy(xor_fraction=fraction))
    saved = []
    for step in range(3):
        if step:
            fp32_step(state, 10 + step)
        repo.save("ft", step, state)
        saved.append({k: v.clone() for k, v in state.items()})
    assert xor_entries(repo, 1) == (3 if fraction == 0.7 else 0)
    assert_loads_exactly(tmp_path / "r", saved)

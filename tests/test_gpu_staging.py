"""save_async of CUDA state on a GPU: pinned staging buffers reused across saves, device→host copies issued
asynchronously on a side stream (after the kernels queued before the call), a stall much shorter than the save.

Every test is skipped without a CUDA device; tests/test_staging.py covers the double buffering and simulates the
pinned-buffer selection on CPU."""

import time

import pytest
import torch

import luopan
from luopan.checkpoint import buffers

from .test_staging import HookStore, returns_promptly


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False here (tests/test_staging.py covers "
                    "the staging logic on CPU)")


def staged(repo):
    """The host buffer set the newest save_async copied into."""
    return repo.checkpointing._staging.sets[repo.checkpointing._staging.last]


def bits(t):
    """A tensor's exact bytes on the host (conj/neg resolved, C order)."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8)


def cuda_state(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    return {
        "w": torch.randn(1024, 1024, device=dev, generator=g),
        "bf16": torch.randn(512, 256, device=dev, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (4096,), device=dev, generator=g),
        "strided": torch.randn(256, 512, device=dev, generator=g).t(),  # not contiguous
        "conj": torch.randn(64, dtype=torch.complex64, device=dev, generator=g).conj(),
        "mask": torch.rand(1000, device=dev, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, device=dev),
        "host": torch.randn(300, 7, generator=torch.Generator().manual_seed(seed)),  # a CPU leaf among them
    }


def expected_of(state):
    return {k: bits(v) for k, v in state.items()}


def assert_bit_exact(out, expected, state):
    assert out.keys() == expected.keys()
    for k, exp in expected.items():
        assert out[k].dtype == state[k].dtype and tuple(out[k].shape) == tuple(state[k].shape), k
        assert torch.equal(bits(out[k]), exp), k


def test_cuda_state_round_trips_bit_exact(tmp_path):
    repo = luopan.open(tmp_path / "r")
    state = cuda_state(0)
    expected = expected_of(state)
    handle = repo.save_async("r", 1, state)
    with torch.no_grad():
        for v in state.values():  # the training loop goes on at once, on the current stream
            if v.dtype.is_floating_point:
                v.mul_(-1)
            elif v.dtype == torch.bool:
                v.logical_not_()
            elif not v.is_complex():
                v.add_(1)
    handle.wait()
    assert_bit_exact(repo.load("r", 1), expected, state)
    assert repo.verify().ok
    repo.close()


def test_buffers_are_pinned_and_reused_across_saves(tmp_path):
    repo = luopan.open(tmp_path / "r")
    state = cuda_state(1)
    repo.save_async("r", 1, state).wait()
    first = staged(repo)
    pins = first.pinned()
    assert len(pins) == sum(1 for v in state.values() if v.is_cuda)  # one pinned buffer per device tensor
    assert all(p.is_pinned() for p in pins)
    addresses = {k: b.ctypes.data for k, b in first._bufs.items()}
    assert {p.data_ptr() for p in pins} <= set(addresses.values())
    with torch.no_grad():
        state["w"].add_(1)
    expected = expected_of(state)
    repo.save_async("r", 2, state).wait()
    assert staged(repo) is first and {k: b.ctypes.data for k, b in first._bufs.items()} == addresses
    assert_bit_exact(repo.load("r", 2), expected, state)
    repo.close()


def test_overlapping_saves_use_two_pinned_sets_then_reuse_them():
    store = HookStore()
    repo = luopan.open(store)
    states = {s: cuda_state(s) for s in (1, 2, 3)}
    expected = {s: expected_of(st) for s, st in states.items()}
    store.close_gate()
    repo.save_async("r", 1, states[1])
    store.wait_blocked()
    returns_promptly(repo.save_async, "r", 2, states[2])  # copies while save 1 is still writing
    sets = repo.checkpointing._staging.sets
    assert all(p.is_pinned() for s in sets for p in s.pinned()) and sets[0].pinned() and sets[1].pinned()
    before = [{p.data_ptr() for p in s.pinned()} for s in sets]
    store.gate.set()
    repo.save_async("r", 3, states[3]).wait()  # into whichever set is free: its pinned buffers, not new ones
    assert [{p.data_ptr() for p in s.pinned()} for s in sets] == before
    for s in (1, 2, 3):
        assert_bit_exact(repo.load("r", s), expected[s], states[s])
    repo.close()


def test_the_copy_sees_kernels_queued_before_the_call(tmp_path):
    repo = luopan.open(tmp_path / "r")
    n = 4096
    a = torch.randn(n, n, device="cuda") / n ** 0.5
    x = torch.zeros(n, n, device="cuda")
    torch.cuda.synchronize()
    y = a
    for _ in range(20):  # tens of milliseconds of queued work, then the write save_async must see
        y = y @ a
    x.copy_(y)
    handle = repo.save_async("r", 1, {"x": x})  # no synchronize before the call
    expected = x.cpu()
    handle.wait()
    assert expected.abs().sum() > 0
    assert torch.equal(repo.load("r", 1)["x"].cpu(), expected)
    repo.close()


def test_pinning_failure_falls_back_to_pageable_copies(tmp_path, monkeypatch):
    def refuse(n):
        raise RuntimeError("simulated cudaHostAlloc failure")

    monkeypatch.setattr(buffers, "_pin_alloc", refuse)
    repo = luopan.open(tmp_path / "r")
    state = cuda_state(4)
    expected = expected_of(state)
    repo.save_async("r", 1, state).wait()
    assert staged(repo).pinned() == []
    assert_bit_exact(repo.load("r", 1), expected, state)
    repo.close()


def test_stall_is_much_less_than_the_save(tmp_path):
    repo = luopan.open(tmp_path / "r")
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": torch.randn(4096, 4096, device="cuda", generator=g) for i in range(8)}  # 512 MiB
    repo.save_async("r", 0, state).wait()  # first save: allocates (pins) the buffers
    ratios = []
    for step in (1, 2):
        with torch.no_grad():
            for v in state.values():
                v.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = repo.save_async("r", step, state)
        stall = time.perf_counter() - t0
        handle.wait()
        total = time.perf_counter() - t0
        ratios.append((stall, total))
    best = min(ratios, key=lambda st: st[0] / st[1])
    assert best[0] < 0.25 * best[1], f"stall {best[0]:.3f} s of a {best[1]:.3f} s save ({ratios})"
    repo.close()

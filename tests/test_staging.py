"""save_async staging on CPU: two buffer sets (a copy overlaps the previous save's writes), saves committed in order,
buffers reused, errors never dropped, reuse decided against committed saves only, and the pinned-buffer selection
(simulated: this machine has no GPU; tests/test_gpu_staging.py runs the real thing on one)."""

import contextlib
import logging
import subprocess
import threading

import numpy as np
import pytest
import torch

import luopan
from luopan.checkpoint import buffers
from luopan.format.names import manifest_key
from luopan.store import MemoryStore

from .conftest import PYTHON

ROWS, DIM = 4096, 64  # a 1 MiB table: 64 KiB chunks hold 256 rows


class HookStore(MemoryStore):
    """A memory store whose pack writes wait while ``gate`` is closed (``blocked`` says one is waiting) and can be
    made to fail (``fail`` writes, or ``fail_once``); it records the order of every write."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()
        self.fail = 0  # pack writes left to fail
        self.writes = []
        self._mutex = threading.Lock()

    def _hook(self, key):
        if key.startswith("packs/"):
            if not self.gate.is_set():
                self.blocked.set()
                assert self.gate.wait(30), "gate never opened"
            with self._mutex:
                failing, self.fail = self.fail > 0, max(0, self.fail - 1)
            if failing:
                raise OSError(5, f"injected I/O error writing {key}")
        self.writes.append(key)

    def put(self, key, data):
        self._hook(key)
        return super().put(key, data)

    def put_if_absent(self, key, data):
        self._hook(key)
        return super().put_if_absent(key, data)

    def close_gate(self):
        self.blocked.clear()
        self.gate.clear()

    def wait_blocked(self):
        assert self.blocked.wait(30), "the background save never reached a pack write"

    def committed_order(self, run):
        return [k for k in self.writes if k.startswith(f"runs/{run}/ckpt/") and k.endswith(".json")]


def model(seed, n=4, rows=128):
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(rows, 256, generator=g) for i in range(n)}


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def addresses(buffer_set):
    return {key: buf.ctypes.data for key, buf in buffer_set._bufs.items()}


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, box) where box gets "result" or "error"."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def returns_promptly(fn, *args, **kwargs):
    t, box = in_thread(fn, *args, **kwargs)
    t.join(20)
    assert not t.is_alive(), "save_async blocked while the previous save was writing"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.fixture
def store():
    return HookStore()


@pytest.fixture
def repo(store):
    r = luopan.open(store)
    yield r
    store.gate.set()
    try:
        r.close()
    except OSError:
        pass


# -- overlap ---------------------------------------------------------------------------------------------------------

def test_second_save_copies_while_the_first_is_still_writing(store, repo):
    s1, s2 = model(1), model(2)
    store.close_gate()
    h1 = repo.save_async("r", 1, s1)
    store.wait_blocked()  # save 1 is writing (stuck in a pack write)
    expected = clone(s2)
    h2 = returns_promptly(repo.save_async, "r", 2, s2)
    assert not h1.done() and not h2.done()
    staging = repo.checkpointing._staging
    assert [slot.buffers for slot in staging.inflight] == [0, 1]  # two buffer sets, one per save in flight
    for k, v in expected.items():  # save 2's copy is complete, in its own set
        assert np.array_equal(staging.sets[1]._bufs[(f"{k}", v.nbytes)], v.numpy().reshape(-1).view(np.uint8))
    for v in s2.values():
        v.mul_(-1)  # the training loop goes on
    store.gate.set()
    assert h2.wait().step == 2 and h1.done()
    assert store.committed_order("r") == [manifest_key("r", 1), manifest_key("r", 2)]
    assert same(repo.load("r", 1), model(1)) and same(repo.load("r", 2), expected)
    assert repo.verify().ok


def test_a_third_save_waits_for_the_first_and_reuses_its_buffers(store, repo):
    store.close_gate()
    h1 = repo.save_async("r", 1, model(1))
    store.wait_blocked()
    first = addresses(repo.checkpointing._staging.sets[0])
    h2 = returns_promptly(repo.save_async, "r", 2, model(2))
    second = addresses(repo.checkpointing._staging.sets[1])
    assert first and second and set(first.values()).isdisjoint(second.values())
    t, box = in_thread(repo.save_async, "r", 3, model(3))
    t.join(0.5)
    assert t.is_alive() and not h1.done()  # both sets are read by saves in flight: the third call waits
    store.gate.set()
    t.join(30)
    assert not t.is_alive() and "error" not in box
    h3 = box["result"]
    assert h1.done()
    used = repo.checkpointing._staging.last  # the first set (or the second, if save 2 was also done by then), reused
    assert addresses(repo.checkpointing._staging.sets[used]) == (first, second)[used]  # same addresses: nothing reallocated
    h3.wait()
    assert h2.done()
    assert repo.steps("r") == [1, 2, 3]
    assert store.committed_order("r") == [manifest_key("r", s) for s in (1, 2, 3)]
    assert all(same(repo.load("r", s), model(s)) for s in (1, 2, 3))


def test_many_overlapping_saves_use_only_two_buffer_sets(repo):
    seen = set()
    state = model(0)
    expected = {}
    for step in range(8):
        for v in state.values():
            v.add_(1)
        expected[step] = clone(state)
        repo.save_async("r", step, state)  # no wait: saves overlap when the writer is behind
        assert len(repo.checkpointing._staging.inflight) <= 2
        seen |= set(addresses(repo.checkpointing._staging.sets[repo.checkpointing._staging.last]).values())
    repo.drain()
    assert len(seen) <= 2 * len(state)  # never more than two sets' buffers, reused
    assert all(same(repo.load("r", s), e) for s, e in expected.items())


def test_saves_that_finish_between_calls_keep_one_buffer_set(repo):
    state = model(0)
    repo.save_async("r", 1, state).wait()
    before = addresses(repo.checkpointing._staging.sets[0])
    for step in (2, 3):
        repo.save_async("r", step, state).wait()
    assert addresses(repo.checkpointing._staging.sets[0]) == before
    assert repo.checkpointing._staging.sets[1]._bufs == {}  # the second set is never allocated


def test_overlap_false_waits_and_frees_the_other_set(store, repo):
    store.close_gate()
    h1 = repo.save_async("r", 1, model(1))
    store.wait_blocked()
    returns_promptly(repo.save_async, "r", 2, model(2))
    assert repo.checkpointing._staging.sets[0]._bufs and repo.checkpointing._staging.sets[1]._bufs
    t, box = in_thread(repo.save_async, "r", 3, model(3), overlap=False)
    t.join(0.5)
    assert t.is_alive() and not h1.done()  # without overlap the call waits for the saves in flight
    store.gate.set()
    t.join(30)
    assert "error" not in box
    box["result"].wait()
    used = repo.checkpointing._staging.last
    assert repo.checkpointing._staging.sets[1 - used]._bufs == {}  # one set of host memory again
    assert repo.steps("r") == [1, 2, 3]


# -- what a save decides while a previous one is in flight -----------------------------------------------------------

def test_a_save_of_a_step_in_flight_waits_and_is_refused(store, repo):
    store.close_gate()
    repo.save_async("r", 1, model(1))
    store.wait_blocked()
    t, box = in_thread(repo.save_async, "r", 1, model(2))
    t.join(0.5)
    assert t.is_alive()  # whether step 1 exists is decided by the save in flight: wait for it
    store.gate.set()
    t.join(30)
    assert isinstance(box.get("error"), luopan.CheckpointExistsError)
    assert same(repo.load("r", 1), model(1))


def test_inputs_may_name_a_checkpoint_in_flight(store, repo):
    store.close_gate()
    repo.save_async("a", 1, model(1))
    store.wait_blocked()
    t, box = in_thread(repo.save_async, "b", 1, model(2), inputs=["a@1"])
    store.gate.set()
    t.join(30)
    assert "error" not in box, box.get("error")
    box["result"].wait()
    assert repo.manifest("b", 1).doc["inputs"] == ["a@1"]


def test_trusted_reuse_waits_for_the_save_in_flight(store, repo):
    base, adapter = model(0), torch.zeros(16, 16)
    state = {"base": base, "adapter": adapter}
    repo.save_async("r", 0, state, trust_versions=True).wait()
    store.close_gate()
    adapter.add_(1)
    h1 = repo.save_async("r", 1, state, trust_versions=True)  # base skipped: nothing in flight
    assert {path for path, _ in repo.checkpointing._staging.sets[repo.checkpointing._staging.last]._bufs} == {"adapter"}
    store.wait_blocked()
    adapter.add_(1)
    t, box = in_thread(repo.save_async, "r", 2, state, trust_versions=True)
    t.join(0.5)
    assert t.is_alive() and not h1.done()  # it could skip the base: it decides once save 1 has committed
    store.gate.set()
    t.join(30)
    box["result"].wait()
    assert {path for path, _ in repo.checkpointing._staging.sets[repo.checkpointing._staging.last]._bufs} == {"adapter"}
    assert repo.manifest("r", 2).entry("base/w0")["chunks"] == repo.manifest("r", 0).entry("base/w0")["chunks"]
    assert torch.equal(repo.load("r", 2)["adapter"], torch.full((16, 16), 2.0))
    assert same(repo.load("r", 2)["base"], base)


def test_trusted_save_with_nothing_skippable_still_overlaps(store, repo):
    state = model(0)
    repo.save_async("r", 0, state, trust_versions=True).wait()
    store.close_gate()
    for v in state.values():
        v.add_(1)
    h1 = repo.save_async("r", 1, state, trust_versions=True)
    store.wait_blocked()
    for v in state.values():
        v.add_(1)  # every tensor changes (e.g. a full fine-tune): nothing could be skipped
    expected = clone(state)
    h2 = returns_promptly(repo.save_async, "r", 2, state, trust_versions=True)
    store.gate.set()
    h2.wait()
    assert h1.done() and same(repo.load("r", 2), expected)


def test_reuse_is_never_decided_against_a_save_in_flight(store, repo):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    repo.save_async("r", 0, {"w": a}, trust_versions=True).wait()  # committed: w is a
    store.close_gate()
    repo.save_async("r", 1, {"w": b}, trust_versions=True)  # in flight: w is b
    store.wait_blocked()
    # a's version record matches the committed save 0, but save 1 (in flight) will be the previous save when this
    # one commits: reusing "the previous chunks" would store b's bytes as a. a is copied instead.
    h2 = returns_promptly(repo.save_async, "r", 2, {"w": a}, trust_versions=True)
    assert {path for path, _ in repo.checkpointing._staging.sets[repo.checkpointing._staging.last]._bufs} == {"w"}
    store.gate.set()
    h2.wait()
    assert torch.equal(repo.load("r", 2)["w"], a) and torch.equal(repo.load("r", 1)["w"], b)


def test_space_preflight_counts_the_saves_in_flight(store, repo):
    state = model(1)
    nbytes = sum(v.nbytes for v in state.values())
    free = {"bytes": 10**12}
    store.free_bytes = lambda: free["bytes"]
    store.close_gate()
    repo.save_async("r", 1, state)
    store.wait_blocked()
    free["bytes"] = int(1.5 * (nbytes + (64 << 10))) + 4096  # room for one save, not for it and the one in flight
    t, box = in_thread(repo.save_async, "r", 2, model(2))
    t.join(0.5)
    assert t.is_alive()  # it does not fit next to save 1: decide once save 1 is done
    store.gate.set()
    t.join(30)
    assert "error" not in box, box.get("error")  # alone it fits (this store's free bytes do not shrink)
    box["result"].wait()
    store.close_gate()
    repo.save_async("r", 3, model(3))
    store.wait_blocked()
    free["bytes"] = nbytes  # not even alone
    t, box = in_thread(repo.save_async, "r", 4, model(4))
    store.gate.set()
    t.join(30)
    assert isinstance(box.get("error"), luopan.InsufficientSpaceError)
    assert repo.steps("r") == [1, 2, 3]


def test_hints_relative_to_a_save_that_failed_are_not_trusted(store):
    repo = luopan.open(store, chunk_size=64 << 10, delta_policy=luopan.DeltaPolicy(min_bytes=1 << 20,
                                                                                    rebase_fraction=0.25))
    emb = np.random.default_rng(0).standard_normal((ROWS, DIM), dtype=np.float32)
    repo.save("r", 0, {"emb": emb})
    store.close_gate()
    emb[0:10] += 1
    h1 = repo.save_async("r", 1, {"emb": emb}, touched_rows={"emb": np.arange(0, 10)})
    store.wait_blocked()
    emb[10:20] += 1  # rows 10..19 changed since save 1 (same chunk as rows 0..9)
    expected = emb.copy()
    returns_promptly(repo.save_async, "r", 2, {"emb": emb}, touched_rows={"emb": np.arange(10, 20)})
    store.fail = 1  # save 1 fails: save 2's hint misses rows 0..9, which changed since the last committed save
    store.gate.set()
    with pytest.raises(OSError, match="injected"):
        h1.wait()
    repo.drain()
    assert repo.steps("r") == [0, 2]
    assert np.array_equal(repo.load("r", 2)["emb"], expected)
    repo.close()


# -- errors ----------------------------------------------------------------------------------------------------------

def test_error_of_a_save_overlapped_by_the_next_surfaces_on_the_call_after(store, repo):
    store.close_gate()
    h1 = repo.save_async("r", 1, model(1))
    store.wait_blocked()
    h2 = returns_promptly(repo.save_async, "r", 2, model(2))
    store.fail = 1
    store.gate.set()
    assert h2.wait().step == 2  # a later save commits on its own
    with pytest.raises(OSError, match="injected") as info:
        repo.save_async("r", 3, model(3))  # nobody looked at save 1's failure: it comes out here
    assert "step 1" in " ".join(getattr(info.value, "__notes__", []))
    assert h1.done()
    repo.save_async("r", 3, model(3)).wait()  # raised once
    assert repo.steps("r") == [2, 3]


def test_several_unseen_errors_are_raised_together_by_close(store):
    repo = luopan.open(store)
    store.close_gate()
    repo.save_async("r", 1, model(1))
    store.wait_blocked()
    returns_promptly(repo.save_async, "r", 2, model(2))
    store.fail = 10**6
    store.gate.set()
    with pytest.raises(OSError, match="injected") as info:
        repo.close()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "step 1" in notes and "step 2 failed too" in notes
    assert repo.steps("r") == []


def test_an_observed_error_is_not_raised_again(store, repo):
    store.close_gate()
    h1 = repo.save_async("r", 1, model(1))
    store.wait_blocked()
    h2 = returns_promptly(repo.save_async, "r", 2, model(2))
    store.fail = 1
    store.gate.set()
    with pytest.raises(OSError):
        h1.wait()
    h2.wait()
    repo.save_async("r", 3, model(3)).wait()
    repo.drain()
    assert repo.steps("r") == [2, 3]


def test_verify_waits_for_every_save_in_flight(store, repo):
    store.close_gate()
    repo.save_async("r", 1, model(1))
    store.wait_blocked()
    returns_promptly(repo.save_async, "r", 2, model(2))
    store.gate.set()
    assert repo.verify().checkpoints == 2


# -- pinned staging (simulated) ----------------------------------------------------------------------------------------

@pytest.fixture
def fake_device(monkeypatch):
    """Every torch leaf counts as a device tensor; the pinned allocator is a recording stand-in."""
    calls = []

    def alloc(n):
        calls.append(n)
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(buffers, "_on_device", lambda t: True)
    monkeypatch.setattr(buffers, "_pin_alloc", alloc)
    return calls


def test_pinned_buffers_only_when_cuda_is_available(monkeypatch, fake_device, repo):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = model(1)
    repo.save_async("r", 1, state).wait()
    assert fake_device == [] and repo.checkpointing._staging.sets[0].pinned() == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    repo.save_async("r", 2, state).wait()
    assert sorted(fake_device) == sorted(v.nbytes for v in state.values())  # one pinned buffer per device leaf
    staged = repo.checkpointing._staging.sets[0]
    assert {t.data_ptr() for t in staged.pinned()} == set(addresses(staged).values())  # the buffers are the pins
    before = addresses(staged)
    for v in state.values():
        v.add_(1)
    expected = clone(state)
    repo.save_async("r", 3, state).wait()
    assert len(fake_device) == len(state) and addresses(staged) == before  # reused, not pinned again
    assert same(repo.load("r", 2), model(1)) and same(repo.load("r", 3), expected)


def test_cpu_tensors_are_never_pinned(monkeypatch, repo):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buffers, "_pin_alloc", lambda n: calls.append(n))
    repo.save_async("r", 1, model(1)).wait()
    assert calls == [] and repo.checkpointing._staging.sets[0].pinned() == []


def test_pinning_failure_falls_back_to_pageable_buffers(monkeypatch, fake_device, repo, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def refuse(n):
        calls.append(n)
        raise RuntimeError("cudaHostAlloc failed: out of memory")

    monkeypatch.setattr(buffers, "_pin_alloc", refuse)
    monkeypatch.setattr(buffers, "_pin_failure_logged", False)
    state = model(1)
    with caplog.at_level(logging.DEBUG, logger="luopan"):
        repo.save_async("r", 1, state).wait()
        repo.save_async("r", 2, state).wait()
    assert len(calls) == len(state)  # tried once per buffer, not again on every save
    assert repo.checkpointing._staging.sets[0].pinned() == [] and len(repo.checkpointing._staging.sets[0]._bufs) == len(state)
    assert len([r for r in caplog.records if "cannot pin" in r.getMessage()]) == 1
    assert same(repo.load("r", 2), state)


def test_real_pinning_without_cuda_returns_no_buffer():
    if torch.cuda.is_available():
        pytest.skip("this machine can pin memory")
    assert buffers._pin(4096) is None


def test_exit_without_close_commits_every_save_in_flight(tmp_path, child_env):
    code = ("import sys, numpy as np, luopan\n"
            "repo = luopan.open(sys.argv[1])\n"
            "for step in (1, 2):\n"
            "    repo.save_async('r', step, {'w': np.full((512, 1024), step, dtype=np.float32)})\n")  # no wait/close
    out = subprocess.run([PYTHON, "-c", code, str(tmp_path / "r")], env=child_env, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    repo = luopan.open(tmp_path / "r")
    assert repo.steps("r") == [1, 2] and repo.verify().ok
    assert float(repo.load("r", 2)["w"][0, 0]) == 2.0


class _FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports a CUDA device: drives the side-stream code path with stand-ins for torch.cuda."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_device_copies_run_on_a_side_stream_and_are_waited_for_once(monkeypatch, repo):
    log = []

    class Event:
        def synchronize(self):
            log.append("synchronize")

    class Stream:
        def __init__(self, device=None):
            log.append(f"new stream on {device}")

        def wait_stream(self, other):
            log.append(f"wait for {other}")

        def record_event(self):
            log.append("record")
            return Event()

    @contextlib.contextmanager
    def context(what):
        log.append(f"enter {type(what).__name__}")
        yield

    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if isinstance(src, _FakeCudaTensor):
            log.append(f"copy non_blocking={non_blocking}")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "the current stream")
    monkeypatch.setattr(torch.cuda, "stream", context)
    monkeypatch.setattr(torch.cuda, "device", context)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(buffers, "_pin_alloc", lambda n: torch.empty(n, dtype=torch.uint8))
    plain = model(1, n=3)
    state = {k: _FakeCudaTensor._make_subclass(_FakeCudaTensor, v) for k, v in plain.items()}
    state["host"] = torch.ones(10)  # a CPU leaf: copied on the host, not on the stream
    repo.save_async("r", 1, state).wait()
    copies = [e for e in log if e.startswith("copy")]
    assert len(copies) >= 3 and set(copies) == {"copy non_blocking=True"}
    assert log[:2] == ["new stream on cuda:0", "wait for the current stream"]  # after the caller's queued kernels
    assert log[-2:] == ["record", "synchronize"] and log.count("synchronize") == 1  # one event, before the hand-off
    log.clear()
    repo.save_async("r", 2, state).wait()
    assert "new stream on cuda:0" not in log and log.count("wait for the current stream") == 1  # stream reused
    assert len(repo.checkpointing._staging.sets[0].pinned()) == 3
    out = repo.load("r", 2)
    assert same({k: out[k] for k in plain}, plain) and torch.equal(out["host"], torch.ones(10))

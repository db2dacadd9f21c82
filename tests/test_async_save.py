"""save_async: returns after a host copy; errors are never swallowed; a kill mid-persist leaves no checkpoint."""

import os
import random
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

import luopan

from .conftest import PYTHON
from .test_commit_failures import FaultyStore


def state(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 256, generator=g) for i in range(n)}, "step": seed}


def test_state_can_change_right_after_save_async_returns(repo):
    s = state()
    expected = {k: v.clone() for k, v in s["model"].items()}
    handle = repo.save_async("r", 1, s, metrics={"loss": torch.tensor(0.5)})
    for v in s["model"].values():
        v.mul_(-1)  # the training loop goes on immediately
    info = handle.wait()
    assert info.step == 1 and handle.done() and info.metrics == {"loss": 0.5}
    out = repo.load("r", 1)
    assert all(torch.equal(out["model"][k], expected[k]) for k in expected)


def test_one_save_in_flight_and_close_flushes(repo_path):
    repo = luopan.open(repo_path)
    s = state()
    handles = []
    for step in range(1, 6):
        handles.append(repo.save_async("r", step, s))
        last = s["model"]["w0"].clone()
        s["model"]["w0"].add_(1)
    repo.close()  # waits for the last one
    assert repo.steps("r") == [1, 2, 3, 4, 5]
    assert all(h.done() for h in handles)
    assert torch.equal(repo.load("r", 5)["model"]["w0"], last)
    assert repo.verify().ok


def test_bad_input_is_raised_synchronously(repo):
    with pytest.raises(luopan.UnsupportedValueError):
        repo.save_async("r", 1, {"f": lambda: 0})
    repo.save("r", 1, state())
    with pytest.raises(luopan.CheckpointExistsError):
        repo.save_async("r", 1, state())


def failing_repo():
    store = FaultyStore()
    repo = luopan.open(store)
    store.prefix, store.when = "packs/", "before"
    return store, repo


def test_background_error_is_raised_by_wait():
    store, repo = failing_repo()
    handle = repo.save_async("r", 1, state())
    with pytest.raises(OSError, match="injected"):
        handle.wait()
    store.prefix = None
    repo.save("r", 2, state())  # already observed: not raised again
    assert repo.steps("r") == [2]


def test_unobserved_background_error_surfaces_on_the_next_call():
    store, repo = failing_repo()
    handle = repo.save_async("r", 1, state())
    while not handle.done():  # finished, but nobody has looked at it
        time.sleep(0.01)
    with pytest.raises(OSError, match="injected"):
        repo.save_async("r", 2, state())  # nobody waited for step 1: its error comes out here
    store.prefix = None
    repo.save_async("r", 2, state()).wait()
    assert repo.steps("r") == [2]


def test_without_overlap_the_next_call_waits_and_raises():
    store, repo = failing_repo()
    repo.save_async("r", 1, state())
    with pytest.raises(OSError, match="injected"):
        repo.save_async("r", 2, state(), overlap=False)  # waits for step 1 first, like a synchronous save
    store.prefix = None
    repo.save_async("r", 2, state(), overlap=False).wait()
    assert repo.steps("r") == [2]


def test_unobserved_background_error_surfaces_on_close():
    _, repo = failing_repo()
    repo.save_async("r", 1, state())
    with pytest.raises(OSError, match="injected"):
        repo.close()


def staged(repo):
    """The host buffer set the newest save_async copied into."""
    return repo.checkpointing._staging.sets[repo.checkpointing._staging.last]


def test_buffers_are_reused_across_saves(repo):
    s = state()
    repo.save_async("r", 1, s).wait()
    bufs = dict(staged(repo)._bufs)
    repo.save_async("r", 2, s).wait()
    assert all(staged(repo)._bufs[k] is v for k, v in bufs.items())
    del s["model"]["w7"]
    repo.save_async("r", 3, s).wait()
    assert len(staged(repo)._bufs) == len(bufs) - 1  # buffers of vanished entries are released


CHILD = '''
import sys, numpy as np, luopan
repo = luopan.open(sys.argv[1], chunk_size=64 * 1024, pack_size=256 * 1024)
steps = repo.steps("a")
step = steps[-1] + 1 if steps else 0
rng = np.random.default_rng(step)
state = {"w": rng.standard_normal((1024, 1024), dtype=np.float32), "step": step}
print("ready", flush=True)
while True:
    repo.save_async("a", step, state, metrics={"step": step})
    step += 1
    state = {"w": np.random.default_rng(step).standard_normal((1024, 1024), dtype=np.float32), "step": step}
'''


def test_kill_during_async_saves_leaves_only_complete_checkpoints(tmp_path, child_env):
    root = str(tmp_path / "repo")
    rnd = random.Random(5)
    for _ in range(10):
        proc = subprocess.Popen([PYTHON, "-c", CHILD, root], env=child_env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rnd.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        repo = luopan.open(root)
        for step in repo.steps("a"):
            assert repo.verify("a", step).ok
            out = repo.load("a", step)
            assert out["step"] == step
            np.testing.assert_array_equal(
                out["w"], np.random.default_rng(step).standard_normal((1024, 1024), dtype=np.float32))
        assert not [f for d, _, fs in os.walk(root) for f in fs if ".tmp-" in f]
    assert luopan.open(root).steps("a"), "some async saves should have committed"


def test_exit_without_close_still_commits(tmp_path, child_env):
    code = ("import sys, numpy as np, luopan\n"
            "repo = luopan.open(sys.argv[1])\n"
            "repo.save_async('r', 1, {'w': np.ones((512, 1024), dtype=np.float32)})\n")  # no wait, no close
    out = subprocess.run([PYTHON, "-c", code, str(tmp_path / "r")], env=child_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    repo = luopan.open(tmp_path / "r")
    assert repo.steps("r") == [1] and repo.verify().ok


def test_wait_timeout_does_not_swallow_the_error():
    store, repo = failing_repo()
    import threading

    gate = threading.Event()
    real = store._maybe_fail

    def slow(key, store_it):
        gate.wait(5)
        return real(key, store_it)

    store._maybe_fail = slow
    handle = repo.save_async("r", 1, state())
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    gate.set()
    with pytest.raises(OSError, match="injected"):
        repo.close()  # the timed-out wait did not count as having seen the failure


def test_inference_tensors_save_with_and_without_trust(repo):
    with torch.inference_mode():
        t = torch.ones(100)
    repo.save("r", 1, {"t": t})
    repo.save("r", 2, {"t": t}, trust_versions=True)
    assert torch.equal(repo.load("r", 2)["t"], torch.ones(100))


def test_trusted_unchanged_tensors_are_not_copied(repo):
    base = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    adapter = torch.zeros(16, 16)
    s = {"base": base, "adapter": adapter}
    repo.save_async("r", 0, s, trust_versions=True).wait()
    adapter.add_(1.0)
    handle = repo.save_async("r", 1, s, trust_versions=True)
    copied = {path for path, _size in staged(repo)._bufs}
    assert copied == {"adapter"}  # the frozen base is neither copied nor read: its previous chunks are reused
    adapter.add_(1.0)  # mutate after the call: the checkpoint keeps the value at the call
    handle.wait()
    out = repo.load("r", 1)
    assert torch.equal(out["adapter"], torch.ones(16, 16))
    assert all(torch.equal(out["base"][k], v) for k, v in base.items())


class GatedStore(luopan.store.MemoryStore):
    """A memory store whose `list` (the first thing a background commit does) waits until the test opens the gate."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def list(self, prefix):
        if threading.current_thread().name.startswith("luopan-save"):  # only the background commit waits
            assert self.gate.wait(30), "gate never opened"
        return super().list(prefix)


def _drop_packs(store):
    for key in store.list("packs/"):
        store.delete(key)


def test_trusted_tensor_whose_chunks_are_gone_is_copied_and_never_read_late():
    store = GatedStore()
    repo = luopan.open(store)
    w = torch.randn(64, 64)
    at_call = w.clone()
    repo.save("r", 0, {"w": w}, trust_versions=True)
    _drop_packs(store)  # its previous chunks are gone before the call: save_async must copy it
    handle = repo.save_async("r", 1, {"w": w}, trust_versions=True)
    assert {path for path, _size in staged(repo)._bufs} == {"w"}
    w.add_(1.0)  # the next optimizer step, right after the call
    handle.wait()
    assert torch.equal(repo.load("r", 1)["w"], at_call)

    repo.save("r", 2, {"w": w}, trust_versions=True)
    store.gate.clear()  # now the chunks vanish after the call (e.g. deleted by another process): fail, never
    handle = repo.save_async("r", 3, {"w": w}, trust_versions=True)  # read the live tensor late
    assert {path for path, _size in staged(repo)._bufs} == set()  # w was vouched for, not copied
    _drop_packs(store)
    store.gate.set()
    with pytest.raises(luopan.LuopanError, match="disappeared before the save could reference them"):
        handle.wait()
    assert repo.steps("r") == [0, 1, 2]

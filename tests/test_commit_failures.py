"""Failures at each step of a save, injected into the store, and two writers saving the same chunks."""

import numpy as np
import pytest

import luopan
from luopan.store import MemoryStore


class FaultyStore(MemoryStore):
    """Fails the write of keys under `prefix`, either before storing (`when="before"`) or after (`"after"`: the
    object is visible but the call reports failure, like a link followed by a failed directory fsync)."""

    def __init__(self):
        super().__init__()
        self.prefix = None
        self.when = "before"

    def _maybe_fail(self, key, store_it):
        if self.prefix and key.startswith(self.prefix):
            if self.when == "after":
                store_it()
            raise OSError(5, f"injected I/O error writing {key}")
        return store_it()

    def put(self, key, data):
        return self._maybe_fail(key, lambda: MemoryStore.put(self, key, data))

    def put_if_absent(self, key, data):
        return self._maybe_fail(key, lambda: MemoryStore.put_if_absent(self, key, data))


def state(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 1024), dtype=np.float32), "b": rng.standard_normal(100)}


@pytest.fixture
def store():
    return FaultyStore()


def packs(store):
    return sorted(store.list("packs/"))


def test_failed_index_write_removes_the_saves_packs(store):
    repo = luopan.open(store, chunk_size=16 * 1024, pack_size=64 * 1024)
    repo.save("r", 1, state(1))
    before = packs(store)
    store.prefix, store.when = "index/", "before"
    with pytest.raises(OSError, match="injected"):
        repo.save("r", 2, state(2))
    assert repo.steps("r") == [1] and packs(store) == before  # nothing referenced them: deleted again
    store.prefix = None
    repo.save("r", 2, state(2))
    assert repo.verify().ok


def test_index_visible_then_failure_keeps_the_packs(store):
    repo = luopan.open(store, chunk_size=16 * 1024, pack_size=64 * 1024)
    store.prefix, store.when = "index/", "after"
    with pytest.raises(OSError, match="injected"):
        repo.save("r", 1, state(1))
    assert repo.steps("r") == []
    assert packs(store), "packs named by a visible index must not be deleted"
    # a later save (a fresh process) dedups against that index: its chunks must really be there
    store.prefix = None
    other = luopan.open(store)
    info = other.save("r", 1, state(1))
    assert info.new_chunks == 0
    assert other.verify().ok
    np.testing.assert_array_equal(other.load("r")["w"], state(1)["w"])


def test_manifest_visible_then_failure_is_retracted(store):
    repo = luopan.open(store)
    repo.save("r", 1, state(1))
    store.prefix, store.when = "runs/", "after"
    with pytest.raises(OSError, match="injected"):
        repo.save("r", 2, state(2))
    assert repo.steps("r") == [1], "a save that raised must not leave its checkpoint behind"
    store.prefix = None
    repo.save("r", 2, state(2))  # and the step is free to be saved again
    assert repo.steps("r") == [1, 2]


def test_a_failed_save_never_deletes_another_writers_packs(store):
    """Writer A writes its packs; before A writes its index, writer B saves the same chunks and commits; then A
    fails. Pack ids carry a per-save nonce, so B never relies on A's packs and A's clean-up cannot break B."""
    a = luopan.open(store, chunk_size=16 * 1024, pack_size=64 * 1024)
    b = luopan.open(store)
    s = state(7)

    fired = []

    def b_saves_then_a_fails(key, store_it):
        if key.startswith("index/") and not fired:
            fired.append(key)
            b.save("rb", 1, {**s, "own": np.arange(5000.0)})  # B commits between A's packs and A's index
            raise OSError(5, "injected failure of A's index write")
        return store_it()

    store._maybe_fail = b_saves_then_a_fails
    with pytest.raises(OSError, match="A's index"):
        a.save("ra", 1, s)
    assert a.steps("ra") == []
    assert b.verify("rb").ok
    np.testing.assert_array_equal(b.load("rb")["w"], s["w"])

"""One backend test suite that every Store passes (subclass StoreSuite and provide ``make_store``)."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from luopan.store import KeyNotFound, Store

KEYS = ["a", "packs/ab/x.pack", "runs/r/ckpt/00000001.json", "refs/runs/r/latest.json", "index/i.json"]


class StoreSuite:
    def make_store(self, tmp_path) -> Store:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        return self.make_store(tmp_path)

    def test_missing_key_raises_keynotfound(self, store):
        for op in (lambda: store.get("nope"), lambda: store.get_range("nope", 0, 1), lambda: store.size("nope")):
            with pytest.raises(KeyNotFound):
                op()
        with pytest.raises(FileNotFoundError):  # KeyNotFound is a FileNotFoundError
            store.get("dir/nope")
        assert not store.exists("nope")

    def test_put_get_roundtrip_and_replace(self, store):
        store.put("x/y", b"hello")
        assert store.get("x/y") == b"hello"
        assert store.size("x/y") == 5
        assert store.exists("x/y")
        store.put("x/y", b"bye")
        assert store.get("x/y") == b"bye"

    def test_put_accepts_buffer_parts(self, store):
        store.put("parts", [b"ab", bytearray(b"cd"), memoryview(b"efgh")[1:3]])
        assert store.get("parts") == b"abcdfg"

    def test_put_if_absent_never_overwrites(self, store):
        assert store.put_if_absent("once", b"first") is True
        assert store.put_if_absent("once", b"second") is False
        assert store.get("once") == b"first"

    def test_get_range_and_read_into(self, store):
        store.put("r", bytes(range(100)))
        assert store.get_range("r", 10, 5) == bytes(range(10, 15))
        assert store.get_range("r", 95, 10) == bytes(range(95, 100))  # short at EOF
        buf = bytearray(8)
        assert store.read_into("r", 50, memoryview(buf)) == 8
        assert bytes(buf) == bytes(range(50, 58))
        short = bytearray(8)
        assert store.read_into("r", 96, memoryview(short)) == 4

    def test_delete_is_idempotent(self, store):
        store.put("d", b"1")
        store.delete("d")
        store.delete("d")
        assert not store.exists("d")

    def test_list_by_prefix(self, store):
        for k in KEYS:
            store.put(k, k.encode())
        assert sorted(store.list("")) == sorted(KEYS)
        assert sorted(store.list("runs/")) == ["runs/r/ckpt/00000001.json"]
        assert list(store.list("nothing/")) == []

    def test_modified_is_the_write_time_or_unknown(self, store):
        import time

        before = time.time()
        store.put("m", b"1")
        stamp = store.modified("m")
        if stamp is not None:  # backends that cannot say return None (gc then relies on its condemn record alone)
            assert before - 5 <= stamp <= time.time() + 5  # object-store clocks: seconds, not sub-second
        with pytest.raises(KeyNotFound):
            store.modified("nope")

    def test_empty_value(self, store):
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.size("empty") == 0

    def test_concurrent_put_if_absent_has_one_winner(self, store):
        wins = []

        def attempt(i):
            if store.put_if_absent("race", f"w{i}".encode()):
                wins.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1
        assert store.get("race") == f"w{wins[0]}".encode()

    def test_matches_dict_model(self, tmp_path):
        """Hypothesis stateful test: the store behaves like a dict under random operations."""
        make = self.make_store
        counter = iter(range(10**9))

        class Machine(RuleBasedStateMachine):
            def __init__(self):
                super().__init__()
                self.store = make(tmp_path / f"m{next(counter)}")
                self.model: dict[str, bytes] = {}

            @rule(k=st.sampled_from(KEYS), v=st.binary(max_size=64))
            def put(self, k, v):
                self.store.put(k, v)
                self.model[k] = v

            @rule(k=st.sampled_from(KEYS), v=st.binary(max_size=64))
            def put_if_absent(self, k, v):
                created = self.store.put_if_absent(k, v)
                assert created == (k not in self.model)
                self.model.setdefault(k, v)

            @rule(k=st.sampled_from(KEYS))
            def delete(self, k):
                self.store.delete(k)
                self.model.pop(k, None)

            @rule(k=st.sampled_from(KEYS), off=st.integers(0, 70), n=st.integers(0, 70))
            def get_range(self, k, off, n):
                if k in self.model:
                    assert self.store.get_range(k, off, n) == self.model[k][off : off + n]

            @invariant()
            def same_contents(self):
                assert sorted(self.store.list("")) == sorted(self.model)
                for k, v in self.model.items():
                    assert self.store.get(k) == v

        Machine.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
        Machine.TestCase().runTest()

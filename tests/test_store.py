import os

import pytest

from luopan.errors import InvalidNameError
from luopan.store import LocalStore, MemoryStore, open_store
from luopan.store.local import TMP_MARK, _HOST

from .store_suite import StoreSuite


class TestMemoryStore(StoreSuite):
    def make_store(self, tmp_path):
        return MemoryStore()


class TestLocalStore(StoreSuite):
    def make_store(self, tmp_path):
        return LocalStore(tmp_path / "store")

    def test_no_temp_files_left_after_writes(self, tmp_path):
        s = self.make_store(tmp_path)
        s.put("a/b", b"x")
        s.put_if_absent("a/c", b"y")
        s.put_if_absent("a/c", b"z")
        names = [n for _, _, files in os.walk(s.root) for n in files]
        assert sorted(names) == ["b", "c"]

    def test_cleanup_removes_only_dead_writers_temporaries(self, tmp_path):
        s = self.make_store(tmp_path)
        s.put("d/keep", b"1")
        d = os.path.join(s.root, "d")
        dead = os.path.join(d, f"x{TMP_MARK}{_HOST}-999999999-abcd")  # no such pid
        live = os.path.join(d, f"y{TMP_MARK}{_HOST}-{os.getpid()}-abcd")
        other_host = os.path.join(d, f"z{TMP_MARK}otherhost-1-abcd")
        for p in (dead, live, other_host):
            open(p, "wb").close()
        assert sorted(s.list("d/")) == ["d/keep"]  # temporaries are never listed
        assert s.cleanup_temporaries() == 1
        assert not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(other_host)

    @pytest.mark.parametrize("bad", ["/abs", "a/../b", "a\\b", "nul\0", ""])
    def test_rejects_unsafe_keys(self, tmp_path, bad):
        s = self.make_store(tmp_path)
        with pytest.raises(ValueError):
            s.put(bad, b"x")


def test_open_store_by_scheme(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert isinstance(open_store("memory://"), MemoryStore)
    with pytest.raises(InvalidNameError, match="unsupported repository URL scheme 'gopher'"):
        open_store("gopher://x/y")

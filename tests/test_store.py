import os
import time

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

    def test_cleanup_removes_only_abandoned_temporaries(self, tmp_path):
        import fcntl

        s = self.make_store(tmp_path)
        s.put("d/keep", b"1")
        d = os.path.join(s.root, "d")
        dead = os.path.join(d, f"x{TMP_MARK}{_HOST}-999999999-abcd")  # nobody holds its lock
        other_host = os.path.join(d, f"z{TMP_MARK}otherhost-1-abcd")  # unlocked and over a minute old
        just_made = os.path.join(d, f"w{TMP_MARK}otherhost-1-abcd")  # unlocked but fresh: maybe between open and flock
        live = os.path.join(d, f"y{TMP_MARK}{_HOST}-{os.getpid()}-abcd")
        for p in (dead, live, other_host, just_made):
            open(p, "wb").close()
        old = time.time() - 120
        os.utime(other_host, (old, old))
        fd = os.open(live, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer in flight holds its temp file's lock until the rename
        try:
            assert sorted(s.list("d/")) == ["d/keep"]  # temporaries are never listed
            assert s.cleanup_temporaries() == 2
            assert not os.path.exists(dead) and not os.path.exists(other_host)
            assert os.path.exists(live) and os.path.exists(just_made)
        finally:
            os.close(fd)
        assert s.cleanup_temporaries() == 0  # unlocked now, but young and its writer (this process) is alive
        os.utime(live, (old, old))
        os.utime(just_made, (old, old))
        assert s.cleanup_temporaries() == 2 and not os.path.exists(live) and not os.path.exists(just_made)

    def test_writer_holds_its_temp_file_lock_until_renamed(self, tmp_path, monkeypatch):
        """Cleanup running in the middle of a put (after the temp file is written, before the rename) must not
        delete the writer's temp file."""
        from luopan.store import local

        s = self.make_store(tmp_path)
        seen = []

        def cleanup_during_write(name):
            if name == "file.fsynced":
                seen.append(s.cleanup_temporaries())

        monkeypatch.setattr(local, "crashpoint", cleanup_during_write)
        s.put("a/b", b"payload")
        assert seen == [0] and s.get("a/b") == b"payload"

    def test_cleanup_tolerates_a_read_only_repository(self, tmp_path):
        s = self.make_store(tmp_path)
        s.put("d/keep", b"1")
        d = os.path.join(s.root, "d")
        open(os.path.join(d, f"x{TMP_MARK}{_HOST}-999999999-abcd"), "wb").close()
        os.chmod(d, 0o555)
        try:
            if os.access(d, os.W_OK):  # root ignores permissions: simulate with a failing unlink instead
                import luopan.store.local as local

                orig = local.os.unlink
                local.os.unlink = lambda p: (_ for _ in ()).throw(PermissionError(13, "read-only", p))
                try:
                    assert s.cleanup_temporaries() == 0
                finally:
                    local.os.unlink = orig
            else:
                assert s.cleanup_temporaries() == 0
        finally:
            os.chmod(d, 0o755)

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


def test_a_store_that_ignores_ranges_is_a_storage_error_not_wrong_bytes():
    from luopan.errors import StorageError

    class NoRanges(MemoryStore):
        def get_range(self, key, offset, length):
            return self.get(key)  # a server or proxy that answers a ranged GET with the whole object

    store = NoRanges()
    store.put("packs/ab/x.pack", b"0123456789")
    out = memoryview(bytearray(4))
    with pytest.raises(StorageError, match="does not honour ranged reads"):
        store.read_into("packs/ab/x.pack", 3, out)
    plain = MemoryStore()
    plain.put("packs/ab/x.pack", b"0123456789")
    assert plain.read_into("packs/ab/x.pack", 3, out) == 4 and bytes(out) == b"3456"

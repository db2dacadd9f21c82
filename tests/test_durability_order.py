"""The commit protocol's system calls, in order (docs/format.md §10 rules 1-5).

Killing a process cannot show that data was fsync'd (the page cache survives a kill), so this test records the
calls the local store makes during a real save and checks their order: every file is fsync'd before it gets its
final name, its directory is fsync'd after, packs are durable before the index, the index before the manifest,
and the manifest before the ref.
"""

import os

import numpy as np

import luopan


def test_save_syscall_order(tmp_path, monkeypatch):
    repo = luopan.open(tmp_path / "r", chunk_size=16 * 1024, pack_size=64 * 1024)
    repo.save("r", 1, {"w": np.zeros(1000)})
    events = []
    fd_path = {}
    real = {name: getattr(os, name) for name in ("open", "close", "fsync", "replace", "link", "rename")}

    def o(path, flags, *a, **k):
        fd = real["open"](path, flags, *a, **k)
        fd_path[fd] = os.fspath(path)
        return fd

    def fs(fd):
        events.append(("fsync", fd_path.get(fd)))
        return real["fsync"](fd)

    def mv(kind):
        def f(src, dst, *a, **k):
            events.append((kind, os.fspath(src), os.fspath(dst)))
            return real[kind](src, dst, *a, **k)
        return f

    monkeypatch.setattr(os, "open", o)
    monkeypatch.setattr(os, "fsync", fs)
    for kind in ("replace", "link", "rename"):
        monkeypatch.setattr(os, kind, mv(kind))
    rng = np.random.default_rng(0)
    repo.save("r", 2, {"w": rng.standard_normal((64, 1024), dtype=np.float32), "b": rng.standard_normal(10)})
    monkeypatch.undo()

    published = [(i, e[2]) for i, e in enumerate(events) if e[0] in ("replace", "link", "rename")]
    assert published, events
    for i, final in published:
        tmp = events[i][1]
        fsynced_tmp = [j for j, e in enumerate(events[:i]) if e == ("fsync", tmp)]
        assert fsynced_tmp, f"{final} got its name before its data was fsync'd"
        dir_sync = [j for j, e in enumerate(events) if j > i and e == ("fsync", os.path.dirname(final))]
        assert dir_sync, f"{final}: its directory was never fsync'd after the rename"

    def durable_at(pred):
        """Index of the directory fsync that made each matching file durable."""
        out = []
        for i, final in published:
            if pred(final):
                out.append(min(j for j, e in enumerate(events) if j > i and e == ("fsync", os.path.dirname(final))))
        return out

    def named_at(pred):
        return [i for i, final in published if pred(final)]

    is_pack = lambda p: p.endswith(".pack")  # noqa: E731
    is_index = lambda p: f"{os.sep}index{os.sep}" in p  # noqa: E731
    is_manifest = lambda p: p.endswith(f"{os.sep}00000002.json")  # noqa: E731
    is_ref = lambda p: p.endswith("latest.json")  # noqa: E731
    assert len(named_at(is_pack)) >= 2 and len(named_at(is_index)) == 1
    assert len(named_at(is_manifest)) == 1 and len(named_at(is_ref)) == 1
    assert max(durable_at(is_pack)) < min(named_at(is_index)), "packs must be durable before the index names them"
    assert max(durable_at(is_index)) < min(named_at(is_manifest)), "index must be durable before the manifest"
    assert max(durable_at(is_manifest)) < min(named_at(is_ref)), "the ref is written last"
    assert repo.verify().ok

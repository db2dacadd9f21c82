"""Crash at every named point of the commit protocol (LUOPAN_CRASH_AT, src/luopan/_crash.py).

A child process opens a repository holding step 1 and saves step 2 (several packs and chunks, some chunks shared
with step 1) with ``LUOPAN_CRASH_AT=<point>``; it must die there (exit 97). Afterwards the repository holds exactly
the old state or exactly the new one, as the commit protocol dictates (docs/format.md §10: the manifest is the
commit point, the ref is written last), and it keeps working.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import luopan
from luopan.repository.packwriter import PACK_WRITES_IN_FLIGHT
from luopan._crash import CRASH_EXIT_CODE
from luopan.format.canonical import unseal

from .conftest import PYTHON
from .helpers import assert_same_state, temp_files

RUN = "cp"
CHUNK_SIZE = 64 * 1024
PACK_SIZE = 256 * 1024
KINDS = ("pack", "index", "manifest", "ref")
PHASES = ("written", "fsynced", "renamed", "dirsynced")

# Before the manifest is visible under its final name nothing is committed: the old state. From the manifest's
# rename on, step 2 is committed. The ref moves to step 2 only once its own rename happened.
OLD = ["chunk.written", *(f"{k}.{p}" for k in ("pack", "index") for p in PHASES), "manifest.written",
       "manifest.fsynced"]
NEW = ["manifest.renamed", "manifest.dirsynced", *(f"ref.{p}" for p in PHASES)]
REF_AT_2 = {"ref.renamed", "ref.dirsynced"}

STATE_SRC = '''
import numpy as np

def make_state(step):
    rng = np.random.default_rng(100 + step)
    return {
        "shared": np.random.default_rng(5).standard_normal((256, 1024), dtype=np.float32),  # 1 MiB, in both steps
        "w": rng.standard_normal((384, 1024), dtype=np.float32),  # 1.5 MiB, new each step
        "v": rng.integers(0, 1 << 40, size=40_000, dtype=np.int64),
        "small": np.arange(10, dtype=np.int32) + step,
        "meta": {"step": step, "name": "crash-test", "ok": True},
    }
'''

CHILD_SRC = STATE_SRC + '''
import sys
import luopan

repo = luopan.open(sys.argv[1])
repo.save(sys.argv[2], int(sys.argv[3]), make_state(int(sys.argv[3])), metrics={"step": int(sys.argv[3])})
'''

_ns: dict = {}
exec(STATE_SRC, _ns)
make_state = _ns["make_state"]


def ref_step(root):
    with open(os.path.join(root, "refs", "runs", RUN, "latest.json"), "rb") as f:
        return unseal(f.read())["step"]


def test_point_lists_cover_every_point():
    assert sorted(OLD + NEW) == sorted(["chunk.written", *(f"{k}.{p}" for k in KINDS for p in PHASES)])
    assert not set(OLD) & set(NEW)


@pytest.fixture
def repo_with_step1(tmp_path):
    root = str(tmp_path / "repo")
    repo = luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE)
    info = repo.save(RUN, 1, make_state(1), metrics={"step": 1})
    assert info.new_chunks > 4 and info.stored_bytes > 2 * PACK_SIZE  # several chunks and packs
    repo.close()
    return root


@pytest.mark.parametrize("point", OLD + NEW)
def test_crash_point(point, repo_with_step1, child_env, tmp_path):
    root = repo_with_step1
    env = dict(child_env, LUOPAN_CRASH_AT=point)
    proc = subprocess.run([PYTHON, "-c", CHILD_SRC, root, RUN, "2"], env=env, cwd=str(tmp_path),
                          capture_output=True, timeout=120)
    assert proc.returncode == CRASH_EXIT_CODE == 97, (
        f"crash point {point} was not reached (rc {proc.returncode}):\n{proc.stderr.decode()}"
    )
    packs_before_open = {f for _, _, fs in os.walk(os.path.join(root, "packs")) for f in fs if ".tmp-" not in f}

    repo = luopan.open(root)
    assert temp_files(root) == [], f"temporaries left after open: {temp_files(root)}"
    expect_new = point in NEW
    steps = repo.steps(RUN)
    old_state, new_state = make_state(1), make_state(2)

    if expect_new:
        assert steps == [1, 2], f"{point}: the manifest was renamed into place, step 2 must be committed"
        assert repo.verify(RUN, 1).ok
        report = repo.verify(RUN, 2)
        assert report.ok and report.checkpoints == 1
        assert_same_state(repo.load(RUN, 1), old_state)
        assert_same_state(repo.load(RUN, 2), new_state)
        assert_same_state(repo.load(RUN), new_state)
        assert [c.metrics for c in repo.checkpoints(RUN)] == [{"step": 1}, {"step": 2}]
        # step 2 shares the "shared" chunks with step 1 (dedup) and brought its own packs
        m1, m2 = repo.manifest(RUN, 1), repo.manifest(RUN, 2)
        shared1 = [(c[0], m1.packs[c[1]], c[2]) for c in m1.entry("shared")["chunks"]]
        shared2 = [(c[0], m2.packs[c[1]], c[2]) for c in m2.entry("shared")["chunks"]]
        assert len(shared1) > 1 and shared1 == shared2
        assert m2.stats["new_packs"] >= 2 and m2.stats["new_chunks"] < m2.stats["chunks"]
    else:
        assert steps == [1], f"{point}: nothing may be committed before the manifest's rename, got {steps}"
        assert repo.verify(RUN).ok
        assert_same_state(repo.load(RUN, 1), old_state)
        assert_same_state(repo.load(RUN), old_state)
        with pytest.raises(luopan.CheckpointNotFoundError):
            repo.load(RUN, 2)
        if point.startswith("pack.") or point == "chunk.written":
            # the crash hit the save's first pack write: that pack is visible only once renamed; packs written
            # concurrently (PACK_WRITES_IN_FLIGHT) may also have landed -- unreferenced garbage, never more
            visible_new = len(packs_before_open) - repo.manifest(RUN, 1).stats["new_packs"]
            low = 1 if point in ("pack.renamed", "pack.dirsynced") else 0
            assert low <= visible_new <= PACK_WRITES_IN_FLIGHT, (point, visible_new)
    # the ref is written last: it moves to step 2 only after its own rename
    assert ref_step(root) == (2 if point in REF_AT_2 else 1), point

    # the repository keeps working: redo step 2 (old state) or go on with step 3 (new state)
    nxt = 3 if expect_new else 2
    info = repo.save(RUN, nxt, make_state(nxt), metrics={"step": nxt})
    assert info.step == nxt
    assert repo.steps(RUN) == ([1, 2, 3] if expect_new else [1, 2])
    report = repo.verify()
    assert report.ok and report.checkpoints == (3 if expect_new else 2)
    assert_same_state(repo.load(RUN, nxt), make_state(nxt))
    assert ref_step(root) == nxt
    repo.close()

    # and a fresh process sees the same
    repo = luopan.open(root)
    assert_same_state(repo.load(RUN), make_state(nxt))
    repo.close()


# Creating a repository writes its config (``luopan.json``, crash points ``file.*``). A crash there must not leave a
# directory that luopan can neither open nor create a repository in: temporaries are ignored by readers and removed
# on open (docs/format.md §2, §10 rule 10).
CREATE_SRC = '''
import sys
import luopan

luopan.open(sys.argv[1], chunk_size=int(sys.argv[2]))
'''


@pytest.mark.parametrize("point", [f"file.{p}" for p in PHASES])
def test_crash_while_creating_repo(point, tmp_path, child_env):
    root = str(tmp_path / "new-repo")
    env = dict(child_env, LUOPAN_CRASH_AT=point)
    proc = subprocess.run([PYTHON, "-c", CREATE_SRC, root, str(CHUNK_SIZE)], env=env, cwd=str(tmp_path),
                          capture_output=True, timeout=120)
    assert proc.returncode == CRASH_EXIT_CODE, f"{point} not reached (rc {proc.returncode}):\n{proc.stderr.decode()}"
    config_visible = point in ("file.renamed", "file.dirsynced")
    assert os.path.exists(os.path.join(root, "luopan.json")) == config_visible

    repo = luopan.open(root, chunk_size=CHUNK_SIZE)  # must open (or finish creating) the repository
    assert temp_files(root) == []
    assert repo.config.chunk_size == CHUNK_SIZE
    repo.save(RUN, 1, make_state(1))
    assert repo.verify().ok
    assert_same_state(repo.load(RUN), make_state(1))
    repo.close()

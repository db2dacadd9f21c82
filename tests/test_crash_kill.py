"""SIGKILL a saving process at random moments; the repository must always hold only complete checkpoints.

One long-lived child per kill saves consecutive steps of a deterministic state (NumPy only, so it starts fast) into
a repository with small chunks and packs, so a save writes several pack files. The parent kills it after a random
delay, then checks docs/format.md §11: previous checkpoints intact, no partial checkpoint visible, the newest one
loads bit-exactly, and opening the repository removes the dead writer's temporary files. The child resumes from the
latest committed step, so the run makes progress across kills.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest

import luopan
from luopan.format.canonical import unseal

from .conftest import PYTHON
from .helpers import assert_same_state, temp_files

RUN = "killme"
KILLS = 50  # normal suite; the slow variant does SLOW_KILLS
SLOW_KILLS = 300
MAX_DELAY_S = 0.35  # a save of this state takes ~0.05-0.2 s here, so kills spread over the first few saves
CHUNK_SIZE = 64 * 1024
PACK_SIZE = 256 * 1024

# Shared by the child (exec'd there) and the parent: the state saved at each step, a pure function of the step.
# ~3.4 MiB in 5 arrays; "embed" never changes (chunks shared by every checkpoint), "slow" changes every 4 steps,
# the rest every step (~2.3 MiB new per save, i.e. ~9 packs).
STATE_SRC = '''
import numpy as np

def make_state(step):
    rng = np.random.default_rng(1000 + step)
    return {
        "model": {
            "embed": np.random.default_rng(7).standard_normal((256, 1024), dtype=np.float32),
            "w": rng.standard_normal((512, 512), dtype=np.float32),
            "bias": np.arange(1000, dtype=np.float64) * step,
        },
        "optim": {
            "m": rng.standard_normal(160 * 1024, dtype=np.float64),
            "slow": np.random.default_rng(step // 4).integers(-30000, 30000, size=(512, 512), dtype=np.int16),
        },
        "step": step,
        "lr": 1.0 / (step + 1),
    }
'''

CHILD_SRC = STATE_SRC + '''
import sys
import luopan
import luopan.repo  # the library itself before "ready" (``import luopan`` alone loads its names on first use)

path, run, chunk_size, pack_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)  # the kill delay starts here: opening the repo can be hit too
repo = luopan.open(path, chunk_size=chunk_size, pack_size=pack_size)
steps = repo.steps(run)
step = steps[-1] + 1 if steps else 0
while True:
    repo.save(run, step, make_state(step), metrics={"loss": 1.0 / (step + 1)})
    print("saved", step, flush=True)
    step += 1
'''

_ns: dict = {}
exec(STATE_SRC, _ns)
make_state = _ns["make_state"]


def kill_phase(root):
    """Where a kill landed, judged from the temporaries it left (before open cleans them)."""
    tops = sorted({os.path.relpath(p, root).split(os.sep)[0] for p in temp_files(root)})
    return "+".join(tops) if tops else "no-temp"


def read_ref_step(root):
    path = os.path.join(root, "refs", "runs", RUN, "latest.json")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return unseal(f.read())["step"]


def run_kills(tmp_path, child_env, kills, seed):
    rnd = random.Random(seed)
    root = str(tmp_path / "repo")
    luopan.open(root, chunk_size=CHUNK_SIZE, pack_size=PACK_SIZE).close()
    stderr_path = tmp_path / "child.err"
    committed: list[int] = []
    verified: set[int] = set()
    reported_ever: set[int] = set()
    phases: collections.Counter[str] = collections.Counter()
    mid_save_kills = 0

    for k in range(kills):
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [PYTHON, "-c", CHILD_SRC, root, RUN, str(CHUNK_SIZE), str(PACK_SIZE)],
                env=child_env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=err,
            )
            try:
                line = proc.stdout.readline()
                assert line == b"ready\n", f"kill {k}: child did not start: {line!r} {stderr_path.read_text()}"
                time.sleep(rnd.uniform(0, MAX_DELAY_S))
                os.kill(proc.pid, signal.SIGKILL)
                rc = proc.wait(timeout=30)
                out = proc.stdout.read().decode()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                proc.stdout.close()
        assert rc == -signal.SIGKILL, f"kill {k}: child exited by itself (rc {rc}):\n{stderr_path.read_text()}"
        reported = [int(w.split()[1]) for w in out.splitlines() if w.startswith("saved ")]
        reported_ever.update(reported)

        phase = kill_phase(root)
        phases[phase] += 1
        if phase != "no-temp":
            mid_save_kills += 1

        repo = luopan.open(root)  # cleans the dead writer's temporaries
        try:
            left = temp_files(root)
            assert not left, f"kill {k}: temporaries survived open: {left}"

            steps = repo.steps(RUN)
            # previous checkpoints stay; steps are consecutive (each child resumes at latest + 1)
            assert steps[: len(committed)] == committed, f"kill {k}: committed steps changed: {committed} -> {steps}"
            assert steps == list(range(len(steps))), f"kill {k}: steps not consecutive: {steps}"
            # every save that returned is durable and visible
            assert reported_ever <= set(steps), f"kill {k}: reported saves {sorted(reported_ever - set(steps))} lost"
            if reported:
                assert steps[-1] <= reported[-1] + 1  # at most the one in flight committed unreported

            # no partial checkpoint: every newly listed manifest parses and all its chunks verify
            for s in steps:
                if s in verified:
                    continue
                m = repo.manifest(RUN, s)
                assert (m.run, m.step) == (RUN, s)
                assert m.metrics == {"loss": 1.0 / (s + 1)}
                report = repo.verify(RUN, s)
                assert report.ok and report.checkpoints == 1 and report.bytes > 3 << 20
                verified.add(s)

            if steps:
                assert_same_state(repo.load(RUN), make_state(steps[-1]))
                ref = read_ref_step(root)
                # the ref is written last: it names a committed step, at most one behind (kill between the two)
                if ref is not None:
                    assert ref in steps and ref >= steps[-1] - 1, f"kill {k}: ref {ref} vs steps {steps[-3:]}"
                elif len(steps) > 1:
                    pytest.fail(f"kill {k}: latest ref missing although steps {steps[-3:]} are committed")
            committed = steps
        finally:
            repo.close()

    # final full check: every checkpoint's manifest parses, every chunk of every checkpoint verifies
    repo = luopan.open(root)
    infos = repo.checkpoints(RUN)
    assert [i.step for i in infos] == committed
    report = repo.verify()
    assert report.ok and report.checkpoints == len(committed)
    for s in rnd.sample(committed, min(5, len(committed))):
        assert_same_state(repo.load(RUN, s), make_state(s))
    repo.close()
    return committed, phases, mid_save_kills


def _check_outcome(committed, phases, mid_save_kills, kills):
    summary = f"committed {len(committed)} steps over {kills} kills; kill phases {dict(phases)}"
    print(summary)
    # progress across kills (each child resumes from the latest step)
    assert len(committed) >= kills // 10, summary
    # kills landed at varied points, including in the middle of pack writes
    assert mid_save_kills >= kills // 10, summary
    assert any("packs" in p for p in phases), summary
    assert len(phases) >= 2, summary


def test_sigkill_during_saves(tmp_path, child_env):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    committed, phases, mid = run_kills(tmp_path, child_env, KILLS, seed)
    _check_outcome(committed, phases, mid, KILLS)


@pytest.mark.slow
def test_sigkill_during_saves_soak(tmp_path, child_env):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    committed, phases, mid = run_kills(tmp_path, child_env, SLOW_KILLS, seed)
    _check_outcome(committed, phases, mid, SLOW_KILLS)

"""Two writer processes save while a third prunes and collects garbage in a loop, for a bounded time, on a local
disk and on the S3 server. Afterwards every committed, retained checkpoint verifies and holds exactly the state its
writer saved — the locks (shared for saves, exclusive for prune/gc) keep gc from deleting or moving data a save is
deduplicating against."""

from __future__ import annotations

import json
import subprocess

import luopan
import luopan.repository.locks

from .conftest import PYTHON
from .helpers import assert_same_state
from .s3server import fresh_url, s3_endpoint  # noqa: F401  (fixture)

STATE = '''
import numpy as np

def make_state(writer, step):
    shared = np.random.default_rng(7).standard_normal(40_000).astype(np.float32)  # same in every run: dedup
    mine = np.random.default_rng(1000 * writer + step // 3).standard_normal(30_000).astype(np.float32)
    fresh = np.random.default_rng(10**6 + 1000 * writer + step).standard_normal(20_000).astype(np.float32)
    return {"shared": shared, "mine": mine, "fresh": fresh, "step": step}
'''

WRITER = STATE + '''
import json, sys, time
import luopan
url, writer, seconds, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
repo = luopan.open(url)
repo.lock_timeout = 120
end = time.time() + seconds
step = 0
with open(log, "w") as out:
    while time.time() < end or step < 4:  # at least 4 saves however slow the machine
        repo.save(f"w{writer}", step, make_state(writer, step))
        out.write(json.dumps(step) + "\\n")
        out.flush()
        step += 1
repo.close()
'''

COLLECTOR = '''
import sys, time
import luopan
from luopan.retention import KeepLast
url, seconds = sys.argv[1], float(sys.argv[2])
repo = luopan.open(url)
repo.lock_timeout = 120
end = time.time() + seconds
rounds = deleted = repacked = 0
# For the bounded time, and on a slow machine until it has run twice and deleted something (at most 120 s more).
while time.time() < end or ((rounds < 2 or not deleted) and time.time() < end + 120):
    for run in repo.runs():
        repo.prune(run, KeepLast(2))
    rep = repo.gc(grace=0, repack_below=0.9)
    rounds += 1
    deleted += rep.deleted_packs
    repacked += rep.repacked_packs
print(rounds, deleted, repacked)
'''


def run_race(url: str, tmp_path, env, seconds: float) -> None:
    luopan.open(url, chunk_size=32 << 10, pack_size=128 << 10).close()
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    writers = [subprocess.Popen([PYTHON, "-c", WRITER, url, str(i), str(seconds), str(logs[i])], env=env,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    collector = subprocess.Popen([PYTHON, "-c", COLLECTOR, url, str(seconds)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    for p in writers:
        _out, errs = p.communicate(timeout=seconds + 240)
        assert p.returncode == 0, errs
    out, errs = collector.communicate(timeout=seconds + 240)
    assert collector.returncode == 0, errs
    rounds, deleted, repacked = map(int, out.split())
    assert rounds >= 2 and deleted > 0, (rounds, deleted, repacked)  # gc really ran between the saves

    ns: dict = {}
    exec(STATE, ns)
    repo = luopan.open(url)
    repo.verify()  # every committed, retained checkpoint, every chunk
    for i, log in enumerate(logs):
        committed = [json.loads(line) for line in log.read_text().split()]
        assert len(committed) >= 3
        steps = repo.steps(f"w{i}")
        assert steps[-1] == committed[-1]  # the newest is never pruned
        assert set(steps) <= set(committed)
        for s in steps:
            assert_same_state(repo.load(f"w{i}", s), ns["make_state"](i, s))
    # what is left after one more gc is exactly what the retained checkpoints need
    repo.gc(grace=0, repack_below=0)
    need = {p for r in repo.runs() for s in repo.steps(r) for p in repo.manifest(r, s).doc["packs"]}
    have = {k.rsplit("/", 1)[-1][:-5] for k in repo.store.list("packs/")}
    assert have == need
    assert not luopan.repository.locks.list_locks(repo.store)


def test_two_writers_and_a_collector_on_local_disk(tmp_path, child_env):
    run_race(str(tmp_path / "repo"), tmp_path, child_env, seconds=12)


def test_two_writers_and_a_collector_on_s3(tmp_path, s3_endpoint, child_env):
    run_race(fresh_url(), tmp_path, child_env, seconds=12)

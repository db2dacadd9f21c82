"""LangGraph with several processes on one repository (issue 31): real graphs invoked from three processes, each
seeing the others' threads and histories; prune and compaction while another process writes; a process killed with
SIGKILL while another keeps writing (mid-append, holding the append lock: its torn frame is cut by the next writer,
nothing the other wrote is lost). Before, the second process's saver raised JournalBusyError."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("langgraph.graph", reason="langgraph is not installed")

from langgraph.checkpoint.memory import InMemorySaver

from luopan.journal import Journal
from luopan.langgraph import LuopanSaver

from .conftest import PYTHON, ROOT
from .langgraph_workers import build, cfg, turn
from .test_langgraph_saver import put_chain

WORKERS = os.path.join(ROOT, "tests", "langgraph_workers.py")


def spawn(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, WORKERS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True)


def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def test_graphs_in_three_processes_see_each_others_threads_and_histories(tmp_path, child_env):
    repo, barrier = str(tmp_path / "repo"), tmp_path / "barrier"
    barrier.mkdir()
    workers, threads, turns = 3, 2, 6
    procs = [spawn(child_env, "graph", repo, f"w{w}", str(workers), str(threads), str(turns), str(barrier))
             for w in range(workers)]
    results = [result(p) for p in procs]
    ref = build(InMemorySaver())  # the same turns on LangGraph's own in-memory saver: what each thread must hold
    for i in range(turns):
        turn(ref, "ref", i)
    want = [len(ref.get_state(cfg("ref")).values["messages"]), len(list(ref.get_state_history(cfg("ref"))))]
    assert want == [2 * turns, 3 * turns]
    everyone = sorted(f"w{w}-t{t}" for w in range(workers) for t in range(threads))
    for r in results:  # each process's saver, still open, sees every process's threads whole
        assert r["listed"] == everyone
        assert r["seen"] == {thread: want for thread in everyone}
    with LuopanSaver(repo) as saver:  # and so does a new one; values read back as written
        app = build(saver)
        state = app.get_state(cfg("w2-t1"))
        assert state.values["messages"][0] == "w2-t1 says 0: " + "u" * 80
        assert state.values["turns"] == turns
        assert len({tup.config["configurable"]["checkpoint_id"] for tup in saver.list(None)}) == 6 * 3 * turns


def test_prune_and_compaction_while_another_process_writes(tmp_path, child_env):
    repo = str(tmp_path / "repo")
    stop = str(tmp_path / "stop")
    with LuopanSaver(repo, compact_min_dead_bytes=1, segment_bytes=1 << 16) as saver:
        noise = spawn(child_env, "noise", repo, stop)
        try:
            deadline = time.monotonic() + 120
            while not any(t.startswith("noise") for t in {c.config["configurable"]["thread_id"]
                                                          for c in saver.list(None, limit=50)}):
                assert time.monotonic() < deadline and noise.poll() is None, "the other process never wrote"
                time.sleep(0.05)
            kept = {}
            for round_ in range(4):
                ids = put_chain(saver, f"mine-{round_}", 12, tag=str(round_))
                saver.prune([f"mine-{round_}"], keep_last=2)  # a DROP record among the other's puts
                kept[f"mine-{round_}"] = ids[-2:]
                saver.compact()  # a snapshot, segments dropped while the other appends
            saver.delete_thread("mine-0")
            del kept["mine-0"]
        finally:
            open(stop, "w").close()
        got = result(noise)
        assert got["puts"] > 20 and got["snapshots"] >= 1
        # every checkpoint either process left is there, from this saver (caught up) and from a new one
        for s in (saver, LuopanSaver(repo)):
            for thread, ids in kept.items():
                assert [t.config["configurable"]["checkpoint_id"] for t in s.list(cfg(thread))] == ids[::-1]
                assert s.get_tuple(cfg(thread)).checkpoint["channel_values"]["messages"][-1].id == f"m{thread[-1]}11"
            assert s.get_tuple(cfg("mine-0")) is None
            for thread, n in got["left"].items():
                tuples = list(s.list(cfg(thread)))
                assert len(tuples) == n, (thread, len(tuples), n)
                if n:
                    assert len(tuples[0].checkpoint["channel_values"]["items"]) >= n
                    assert tuples[0].pending_writes == [(tuples[0].pending_writes[0][0], "items", "w")]
            if s is not saver:
                s.close()


KILLER = """
import os, signal, sys
from luopan.journal import Journal
from luopan.repository import wal
j = Journal(sys.argv[1], name="shared", shared=True)
for i in range(5):
    j.append({"by": "victim", "i": i})
real = wal._write
def half(fd, data, path):  # the process dies holding the append lock, half of its frame written
    real(fd, data[: len(data) // 2], path)
    os.kill(os.getpid(), signal.SIGKILL)
wal._write = half
j.append({"by": "victim", "i": 5, "pad": "x" * 5000})
"""


def test_a_writer_killed_mid_append_loses_nothing_another_wrote(tmp_path, child_env):
    repo = str(tmp_path / "repo")
    with Journal(repo, name="shared", shared=True) as j:
        mine = [j.append({"by": "me", "i": i}) for i in range(3)]
        victim = subprocess.run([PYTHON, "-c", KILLER, repo], env=child_env, capture_output=True, text=True)
        assert victim.returncode == -signal.SIGKILL, victim.stderr
        mine += [j.append({"by": "me", "i": i}) for i in range(3, 40)]  # the first cuts the victim's torn frame
        assert len(j.recovered) == 1 and j.recovered[0].reason == "a record cut short"
        assert mine == list(range(3)) + list(range(8, 45))
    with Journal(repo, name="shared") as again:  # whole again: nothing to cut
        assert again.recovered == []
        records = list(again.read())
    assert records == ([{"by": "me", "i": i} for i in range(3)] + [{"by": "victim", "i": i} for i in range(5)]
                       + [{"by": "me", "i": i} for i in range(3, 40)])


PUTTER = """
import sys
from luopan.langgraph import LuopanSaver
from tests.test_langgraph_saver import put_chain
with LuopanSaver(sys.argv[1]) as saver:
    put_chain(saver, sys.argv[2], 10_000, tag=sys.argv[2])
"""


def test_sigkill_of_one_saver_process_while_another_puts(tmp_path, child_env):
    """Two processes put in a loop; one is killed with SIGKILL at a random moment; the other goes on. Every
    checkpoint either had put (acknowledged: listed by a reader before the kill) is there after."""
    repo = str(tmp_path / "repo")
    env = dict(child_env, PYTHONPATH=ROOT + os.pathsep + child_env["PYTHONPATH"])
    a = subprocess.Popen([PYTHON, "-c", PUTTER, repo, "a"], env=env, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([PYTHON, "-c", PUTTER, repo, "b"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with LuopanSaver(repo) as reader:
            deadline = time.monotonic() + 120
            while min(len(list(reader.list(cfg(t)))) for t in "ab") < 20:
                assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, \
                    (a.poll(), b.poll(), (b.stderr.read() if b.poll() else ""))
                time.sleep(0.02)
            os.kill(a.pid, signal.SIGKILL)
            a.wait()
            before = {t: [c.checkpoint["id"] for c in reader.list(cfg(t))] for t in "ab"}
            while len(list(reader.list(cfg("b")))) < len(before["b"]) + 30:  # the other keeps putting
                assert time.monotonic() < deadline and b.poll() is None
                time.sleep(0.02)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
            p.wait()
    with LuopanSaver(repo) as saver:
        for t in "ab":
            ids = [c.checkpoint["id"] for c in saver.list(cfg(t))]
            assert set(before[t]) <= set(ids)
            assert len(ids) == len(set(ids))
            last = saver.get_tuple(cfg(t)).checkpoint["channel_values"]["messages"]
            assert len(last) == len(ids)  # each put whole: the newest holds one message per checkpoint
        newest = saver.get_tuple(cfg("a")).config
        saver.put_writes(newest, [("x", 1)], "t")  # and it takes writes again
        assert saver.get_tuple(newest).pending_writes == [("t", "x", 1)]


def test_readme_multi_process_example_runs_as_written(tmp_path, child_env):
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    code = next(b for b in blocks if "LuopanSaver(" in b and "multiprocessing" in b)
    (tmp_path / "example.py").write_text(code)
    res = subprocess.run([PYTHON, "example.py"], cwd=tmp_path, env=child_env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == ["user-0 9 checkpoints", "user-1 9 checkpoints"]


def test_savers_of_one_process_in_threads(tmp_path):
    """Several savers of one process on one repository (each its own journal writer), put from threads at once:
    seqs stay unique, every saver sees every thread whole."""
    import threading

    repo = str(tmp_path / "repo")
    savers = [LuopanSaver(repo) for _ in range(3)]
    ids: dict[str, list[str]] = {}

    def work(n: int) -> None:
        ids[f"t{n}"] = put_chain(savers[n], f"t{n}", 15, tag=str(n))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for s in savers:
            for thread, want in ids.items():
                assert [c.config["configurable"]["checkpoint_id"] for c in s.list(cfg(thread))] == want[::-1]
        seqs = [seq for seq, _ in savers[0].journal.items()]
        assert seqs == list(range(45))
    finally:
        for s in savers:
            s.close()

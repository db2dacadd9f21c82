"""LuopanSaver review: a malformed record is a typed IntegrityError; reopening after a crash cut anywhere in the
journal's segment never raises and never returns wrong values; several threads and asyncio.run; the README snippet."""

from __future__ import annotations

import asyncio
import glob
import os
import random
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("langgraph.checkpoint.base", reason="langgraph-checkpoint is not installed")

from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.base.id import uuid6

from luopan.errors import IntegrityError
from luopan.langgraph import LuopanSaver
from luopan.langgraph import records as R

from .conftest import PYTHON, ROOT


def cfg(thread: str, cid: str | None = None) -> dict:
    c: dict = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    if cid:
        c["configurable"]["checkpoint_id"] = cid
    return c


def put_steps(saver: LuopanSaver, thread: str, steps: int, expected: dict | None = None) -> None:
    conf, ver, msgs = cfg(thread), None, []
    for i in range(steps):
        msgs = msgs + [f"{thread} message {i} " + "x" * 120]
        ck = empty_checkpoint()
        ck["id"] = str(uuid6(clock_seq=i))
        ver = saver.get_next_version(ver, None)
        ck["channel_values"] = {"messages": list(msgs), "n": i}
        ck["channel_versions"] = {"messages": ver, "n": ver}
        conf = saver.put(conf, ck, {"step": i}, {"messages": ver, "n": ver})
        saver.put_writes(conf, [("messages", f"w{i}")], f"task{i}")
        got = saver.get_tuple(conf)
        assert got.checkpoint["channel_values"] == ck["channel_values"]
        if expected is not None:
            expected[ck["id"]] = (list(msgs), i)


def test_a_malformed_record_is_an_integrity_error(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo) as saver:
        put_steps(saver, "t", 2)
        saver.journal.append(R.encode([R.PUT, "t"]))
    with pytest.raises(IntegrityError, match="malformed"):
        LuopanSaver(repo)
    shutil.rmtree(repo)
    with LuopanSaver(repo) as saver:
        saver.journal.append(R.encode([R.WRITES, "t", "", "c", "task", "", [[b"short", "msgpack", b"x"]], []]))
    with pytest.raises(IntegrityError, match="malformed"):
        LuopanSaver(repo)


def test_reopen_after_a_crash_anywhere_in_the_segment(tmp_path):
    src = str(tmp_path / "src")
    expected: dict = {}
    with LuopanSaver(src) as saver:
        put_steps(saver, "t", 25, expected)
    seg = max(glob.glob(os.path.join(src, "journals", "langgraph", "log", "*.seg")))
    with open(seg, "rb") as f:
        whole = f.read()
    rng = random.Random(5)
    for trial in range(45):
        dst = str(tmp_path / f"c{trial}")
        shutil.copytree(src, dst)
        # A crash leaves the log's sync mark vouching only for what was synced before it; this garbles records the
        # closed log had synced, so the copy must not keep a mark vouching for them (else it is damage, not a crash:
        # §16.2 raises for a whole record below the mark that does not check).
        mark = os.path.join(dst, "journals", "langgraph", "log", "DURABLE")
        if os.path.exists(mark):
            os.remove(mark)
        cut = rng.randrange(len(whole))
        tail = (b"", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))), b"\0" * (len(whole) - cut))
        with open(seg.replace(src, dst, 1), "wb") as f:
            f.write(whole[:cut] + tail[trial % 3])
        with LuopanSaver(dst) as saver:  # never raises
            ids = [t.config["configurable"]["checkpoint_id"] for t in saver.list(cfg("t"))]
            assert ids == sorted(expected)[:len(ids)][::-1]  # a prefix of what was written survives
            for t in saver.list(cfg("t")):
                msgs, i = expected[t.config["configurable"]["checkpoint_id"]]
                assert t.checkpoint["channel_values"] == {"messages": msgs, "n": i}
                assert [(c, v) for _t, c, v in t.pending_writes] in ([], [("messages", f"w{i}")])
            put_steps(saver, "after", 2)  # and it goes on appending
        shutil.rmtree(dst)


def test_several_threads_share_one_saver(tmp_path):
    with LuopanSaver(str(tmp_path / "repo"), fsync="batch") as saver:
        def work(t: int) -> None:
            put_steps(saver, f"t{t}", 12)
            saver.prune([f"t{t}"], keep_last=3)
            list(saver.list(None, limit=3))
            if t % 4 == 0:
                saver.delete_thread(f"t{t}")
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(work, range(16)))
        assert sorted({t.config["configurable"]["thread_id"] for t in saver.list(None)}) == sorted(
            f"t{t}" for t in range(16) if t % 4)
        assert all(len(list(saver.list(cfg(f"t{t}")))) == 3 for t in range(16) if t % 4)
    with LuopanSaver(str(tmp_path / "repo")) as saver:
        assert len(list(saver.list(None))) == 3 * 12


def test_async_methods_under_asyncio_run(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo) as saver:
        put_steps(saver, "a", 3)
        put_steps(saver, "b", 3)

    async def main() -> tuple:
        async with LuopanSaver(repo) as saver:
            listed = [t async for t in saver.alist(cfg("a"))]
            latest = await saver.aget_tuple(cfg("a"))
            await saver.acopy_thread("a", "c")
            await saver.aprune(["c"], keep_last=1)
            await saver.adelete_for_runs(["nothing"])
            await saver.adelete_thread("b")
            return (len(listed), latest.checkpoint["channel_values"]["n"], await saver.aget_tuple(cfg("b")),
                    len([t async for t in saver.alist(cfg("c"))]))

    assert asyncio.run(main()) == (3, 2, None, 1)


def test_readme_snippet_runs_as_written(tmp_path, child_env):
    docs = [os.path.join(ROOT, *p) for p in (("docs", "readme-langgraph.md"), ("README.md",))]
    blocks = []
    for path in docs:
        if os.path.exists(path):
            with open(path) as f:
                blocks += re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)
    code = next(b for b in blocks if "LuopanSaver(" in b and "StateGraph" in b)
    for expect in ("seen 1 messages", "seen 3 messages"):  # the second run resumes the thread from disk
        res = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=child_env, capture_output=True, text=True, check=False,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip() == expect

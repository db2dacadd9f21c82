"""LuopanSaver beyond the conformance suite: a real StateGraph, reopen, storage growth per step, prune + compact,
pickle refusal, a torn journal tail."""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from typing import Annotated, Any, TypedDict

import pytest

pytest.importorskip("langgraph.checkpoint.base", reason="langgraph-checkpoint is not installed")

from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from luopan.langgraph import LuopanSaver, PickledPayloadError
from luopan.langgraph import records as R

lc = pytest.importorskip("langchain_core.messages", reason="langchain-core is not installed")
TEXT = "All work and no play makes Jack a dull boy. " * 46  # ~2 KiB


def msg(i: int, tag: str = "") -> Any:
    cls = lc.AIMessage if i % 2 else lc.HumanMessage
    return cls(content=f"{tag}{i}: {TEXT}", id=f"m{tag}{i}")


def disk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(root) for f in fs)


def journal_dir(repo: str) -> str:
    return os.path.join(repo, "journals", "langgraph")


def cfg(thread: str, cid: str | None = None, ns: str = "") -> dict:
    c: dict = {"configurable": {"thread_id": thread, "checkpoint_ns": ns}}
    if cid:
        c["configurable"]["checkpoint_id"] = cid
    return c


def put_chain(saver: LuopanSaver, thread: str, steps: int, *, start: int = 0, parent: str | None = None,
              extra: dict | None = None, tag: str = "") -> list[str]:
    """A growing message list, one new message per checkpoint, the way LangGraph's loop puts them."""
    ids, messages = [], [msg(i, tag) for i in range(start)]
    ck = empty_checkpoint()
    for step in range(start, start + steps):
        messages = messages + [msg(step, tag)]
        version = saver.get_next_version(ck["channel_versions"].get("messages"), None)
        ck["channel_versions"] = {**ck["channel_versions"], "messages": version}
        ck["channel_values"] = {"messages": messages, **(extra or {})}
        new = {"messages": version}
        for k in extra or {}:
            if k not in ck["channel_versions"]:
                ck["channel_versions"][k] = new[k] = saver.get_next_version(None, None)
        ck = create_checkpoint(ck, None, step)
        stored = saver.put(cfg(thread, parent), ck, {"source": "loop", "step": step, "run_id": f"run-{thread}"}, new)
        parent = stored["configurable"]["checkpoint_id"]
        ids.append(parent)
    return ids


def snapshot_of(saver: LuopanSaver, thread: str, ids: list[str]) -> dict:
    out = {}
    for cid in ids:
        t = saver.get_tuple(cfg(thread, cid))
        out[cid] = None if t is None else (t.checkpoint, t.metadata, t.parent_config, t.pending_writes)
    return out


# -- a real graph ----------------------------------------------------------------------------------------------
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages


class State(TypedDict):
    messages: Annotated[list, add_messages]
    turns: int


def build_graph():
    def agent(state: State) -> dict:
        n = len(state["messages"])
        return {"messages": [lc.AIMessage(content=f"reply {n}: {TEXT}", id=f"ai-{n}")],
                "turns": state.get("turns", 0) + 1}

    b = StateGraph(State)
    b.add_node("agent", agent)
    b.add_edge(START, "agent")
    b.add_edge("agent", END)
    return b


def test_state_graph_two_threads_survives_reopen(tmp_path):
    repo = str(tmp_path / "repo")
    threads = ["alice", "bob"]
    with LuopanSaver(repo) as saver:
        graph = build_graph().compile(checkpointer=saver)
        for turn in range(5):
            for t in threads:
                graph.invoke({"messages": [lc.HumanMessage(content=f"{t} {turn}: {TEXT}", id=f"{t}-{turn}")]},
                             {"configurable": {"thread_id": t}})
        before = {t: graph.get_state({"configurable": {"thread_id": t}}) for t in threads}
        history = {t: [(s.config, s.values, s.metadata, s.next)
                       for s in graph.get_state_history({"configurable": {"thread_id": t}})] for t in threads}
    for t in threads:
        assert len(before[t].values["messages"]) == 10 and before[t].values["turns"] == 5

    with LuopanSaver(repo) as fresh:
        graph = build_graph().compile(checkpointer=fresh)
        for t in threads:
            after = graph.get_state({"configurable": {"thread_id": t}})
            assert after.values == before[t].values
            assert after.config == before[t].config
            assert [(s.config, s.values, s.metadata, s.next)
                    for s in graph.get_state_history({"configurable": {"thread_id": t}})] == history[t]
        # and it keeps going from where it was
        out = graph.invoke({"messages": [lc.HumanMessage(content="again", id="again")]},
                           {"configurable": {"thread_id": "alice"}})
        assert len(out["messages"]) == 12 and out["turns"] == 6


def test_async_graph(tmp_path):
    async def go() -> Any:
        async with LuopanSaver(str(tmp_path / "repo")) as saver:
            graph = build_graph().compile(checkpointer=saver)
            for turn in range(3):
                await graph.ainvoke({"messages": [lc.HumanMessage(content=f"hi {turn}", id=f"h{turn}")]},
                                    {"configurable": {"thread_id": "t"}})
            states = [s async for s in graph.aget_state_history({"configurable": {"thread_id": "t"}})]
            return (await graph.aget_state({"configurable": {"thread_id": "t"}})).values, states

    values, states = asyncio.run(go())
    assert len(values["messages"]) == 6 and values["turns"] == 3
    assert len(states) == 9  # input + loop per turn, newest first, plus the first empty input
    with LuopanSaver(str(tmp_path / "repo")) as saver:
        assert build_graph().compile(checkpointer=saver).get_state(
            {"configurable": {"thread_id": "t"}}).values == values


# -- storage --------------------------------------------------------------------------------------------------
def test_growth_per_step_is_the_new_message_not_the_list(tmp_path):
    repo = str(tmp_path / "repo")
    one = len(JsonPlusSerializer().dumps_typed(msg(1))[1])
    with LuopanSaver(repo, fsync="off") as saver:
        sizes = []
        parent = None
        for chunk in range(4):
            parent = put_chain(saver, "t", 50, start=50 * chunk, parent=parent)[-1]
            saver.journal.sync()
            sizes.append(disk_bytes(journal_dir(repo)))
        whole_list_bytes = len(JsonPlusSerializer().dumps_typed([msg(i) for i in range(200)])[1])
    per_step = [(b - a) / 50 for a, b in itertools.pairwise(sizes)]
    # steps 50..200: each costs one new message plus bounded bookkeeping, the same at step 190 as at step 60
    for cost in per_step:
        assert cost < one + 2048, (per_step, one)
    assert per_step[-1] < per_step[0] * 1.3, per_step
    assert sizes[-1] < whole_list_bytes * 4  # 200 checkpoints cost less than 4 copies of the final list
    # the data are still all there, exactly
    with LuopanSaver(repo) as saver:
        t = saver.get_tuple(cfg("t"))
        assert t.checkpoint["channel_values"]["messages"] == [msg(i) for i in range(200)]


def test_split_lists_rebuild_exactly_what_the_serializer_returns(tmp_path):
    serde = JsonPlusSerializer(allowed_msgpack_modules=None)
    values = {
        "messages": [msg(i) for i in range(150)],
        "mixed": [None, b"raw" * 400, 7, 2.5, "s" * 500, {"k": [1, 2]}, (1, "tuple"), [msg(1)], True],
        "bytearr": [bytearray(b"x" * 2000), 1],
        "small": [1, 2, 3],
        "empty": [],
        "tuple": tuple(msg(i) for i in range(3)),
    }
    with LuopanSaver(str(tmp_path / "repo")) as saver:
        ck = empty_checkpoint()
        ck["channel_values"] = values
        ck["channel_versions"] = {k: 1 for k in values}
        saver.put(cfg("t"), ck, {}, {k: 1 for k in values})
        got = saver.get_tuple(cfg("t")).checkpoint["channel_values"]
    for k, v in values.items():
        expect = serde.loads_typed(serde.dumps_typed(v))
        assert got[k] == expect and type(got[k]) is type(expect), k
        if k == "mixed":
            assert [type(x) for x in got[k]] == [type(x) for x in expect]


def test_identical_content_is_stored_once(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo, fsync="off") as saver:
        put_chain(saver, "a", 30)
        saver.journal.sync()
        one = disk_bytes(journal_dir(repo))
        saver.copy_thread("a", "b")
        put_chain(saver, "c", 30)  # the same messages on another thread
        saver.journal.sync()
        three = disk_bytes(journal_dir(repo))
        assert three - one < (one / 3), (one, three)
        assert saver.get_tuple(cfg("b")).checkpoint == saver.get_tuple(cfg("a")).checkpoint


# -- prune ----------------------------------------------------------------------------------------------------
def test_prune_keeps_what_later_checkpoints_need(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo, fsync="off") as saver:
        ids = put_chain(saver, "t", 40, extra={"config": {"model": "m", "blob": "z" * 3000}})
        other = put_chain(saver, "u", 10)
        for cid in ids[-5:]:
            saver.put_writes(cfg("t", cid), [("messages", [msg(1000)]), ("turns", 3)], f"task-{cid}")
        keep = ids[-3:]
        before = snapshot_of(saver, "t", keep)
        before_other = snapshot_of(saver, "u", other)
        # "config" was written once, at the first checkpoint: every kept one still needs its value
        assert all(b[0]["channel_values"]["config"]["blob"] == "z" * 3000 for b in before.values())
        size_before = saver.stats()["journal_bytes"]
        saver.prune(["t"], keep_last=3)
        assert [t.config["configurable"]["checkpoint_id"] for t in saver.list(cfg("t"))] == keep[::-1]
        assert snapshot_of(saver, "t", keep) == before
        assert snapshot_of(saver, "t", ids[:-3]) == dict.fromkeys(ids[:-3])
        assert snapshot_of(saver, "u", other) == before_other
        saver.compact()
        assert saver.stats()["journal_bytes"] < size_before
        assert snapshot_of(saver, "t", keep) == before
    with LuopanSaver(repo) as saver:
        assert snapshot_of(saver, "t", keep) == before
        assert snapshot_of(saver, "u", other) == before_other
        put_chain(saver, "t", 3, start=40, parent=keep[-1])  # the thread goes on after prune + reopen
        assert len(saver.get_tuple(cfg("t")).checkpoint["channel_values"]["messages"]) == 43


def test_prune_keeps_delta_channel_ancestors(tmp_path):
    """A DeltaChannel stores a value only at snapshot steps; kept checkpoints need the ancestors (and their writes)
    back to the last one holding a value."""
    with LuopanSaver(str(tmp_path / "repo"), fsync="off") as saver:
        parent, ids = None, []
        for step in range(8):
            ck = create_checkpoint(empty_checkpoint(), None, step)
            ver = step + 1
            ck["channel_versions"] = {"d": ver}
            has = step == 2  # the snapshot step
            ck["channel_values"] = {"d": ["snapshot"]} if has else {}
            meta = {"source": "loop", "step": step, "counters_since_delta_snapshot": {"d": [0, 0]}}
            parent = saver.put(cfg("t", parent), ck, meta, {"d": ver})["configurable"]["checkpoint_id"]
            saver.put_writes(cfg("t", parent), [("d", f"w{step}")], "task")
            ids.append(parent)
        saver.prune(["t"], keep_last=1)
        kept = [t.checkpoint["id"] for t in saver.list(cfg("t"))]
        assert kept == ids[2:][::-1]  # back to the snapshot at step 2
        hist = saver.get_delta_channel_history(config=cfg("t", ids[-1]), channels=["d"])
        assert hist["d"]["seed"] == ["snapshot"]
        assert [w[2] for w in hist["d"]["writes"]] == [f"w{s}" for s in range(2, 7)]
        saver.prune(["t"], strategy="keep_latest")  # idempotent: still needed
        assert [t.checkpoint["id"] for t in saver.list(cfg("t"))] == kept


def test_prune_arguments(tmp_path):
    from luopan.errors import UsageError
    with LuopanSaver(str(tmp_path / "repo"), fsync="off") as saver:
        put_chain(saver, "t", 3)
        with pytest.raises(UsageError):
            saver.prune(["t"], strategy="nope")
        with pytest.raises(UsageError):
            saver.prune(["t"], keep_last=-1)
        saver.prune(["t"], keep_last=0)
        assert saver.get_tuple(cfg("t")) is None


def test_deletes_compact_automatically(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo, fsync="off", compact_min_dead_bytes=1 << 16, segment_bytes=1 << 16) as saver:
        for t in range(6):
            put_chain(saver, f"t{t}", 20, tag=f"t{t}")
        full, log = saver.stats()["journal_bytes"], saver.journal.size_bytes
        for t in range(5):
            saver.delete_thread(f"t{t}")
        assert saver.stats()["journal_bytes"] < full / 2
        assert saver.journal.size_bytes < log / 2  # the log segments the snapshot covers are gone
        assert len(saver.journal.snapshots()) == 1
        expect = saver.get_tuple(cfg("t5")).checkpoint
    with LuopanSaver(repo) as saver:
        assert saver.get_tuple(cfg("t5")).checkpoint == expect
        assert saver.get_tuple(cfg("t0")) is None


# -- safety ---------------------------------------------------------------------------------------------------
class Opaque:
    """Picklable, but nothing msgpack can encode."""

    def __init__(self) -> None:
        self.x = 1


def test_pickle_is_refused_on_write(tmp_path):
    with LuopanSaver(str(tmp_path / "repo"), serde=JsonPlusSerializer(pickle_fallback=True)) as saver:
        ck = empty_checkpoint()
        ck["channel_values"], ck["channel_versions"] = {"x": Opaque()}, {"x": 1}
        with pytest.raises(PickledPayloadError):
            saver.put(cfg("t"), ck, {}, {"x": 1})
        assert saver.get_tuple(cfg("t")) is None


def test_pickled_payload_is_never_loaded(tmp_path):
    repo = str(tmp_path / "repo")
    marker = tmp_path / "pwned"
    # a protocol-0 pickle that would run a shell command if loaded
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    with LuopanSaver(repo) as saver:
        ck = empty_checkpoint()
        key = R.object_key("pickle", payload)
        saver.journal.append(R.encode([R.PUT, "t", "", ck["id"], None, *saver.serde.dumps_typed(ck),
                                       *saver.serde.dumps_typed({}), None, {"x": 1},
                                       [[key, "pickle", payload]], [["x", 1, key]]]))
    for serde in (None, JsonPlusSerializer(pickle_fallback=True)):
        with LuopanSaver(repo, serde=serde) as saver, pytest.raises(PickledPayloadError):
            saver.get_tuple(cfg("t"))
    assert not marker.exists()


def test_with_allowlist_shares_the_journal(tmp_path):
    with LuopanSaver(str(tmp_path / "repo")) as saver:
        clone = saver.with_allowlist([("collections", "OrderedDict")])
        assert clone is not saver and clone.journal is saver.journal
        put_chain(clone, "t", 2)
        assert saver.get_tuple(cfg("t")) is not None


def test_torn_tail_loses_at_most_the_last_put(tmp_path):
    repo = str(tmp_path / "repo")
    with LuopanSaver(repo) as saver:
        ids = put_chain(saver, "t", 6)
        expect = snapshot_of(saver, "t", ids[:-1])
    segments = sorted((os.path.getmtime(p), p) for d, _s, fs in os.walk(journal_dir(repo)) for f in fs
                      if f.endswith(".seg") and os.path.getsize(p := os.path.join(d, f)) > 0)
    last = segments[-1][1]
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 700)  # mid-way through the last put's new message
    with LuopanSaver(repo) as saver:
        assert saver.journal.recovered, "opening should report the cut tail"
        got = [t.checkpoint["id"] for t in saver.list(cfg("t"))]
        assert got[::-1] == ids[:-1]
        assert snapshot_of(saver, "t", ids[:-1]) == expect
        put_chain(saver, "t", 2, start=5, parent=ids[-2])  # writing goes on after the cut
        assert len(saver.get_tuple(cfg("t")).checkpoint["channel_values"]["messages"]) == 7


def test_threads_in_other_namespaces_and_uuid_thread_ids(tmp_path):
    with LuopanSaver(str(tmp_path / "repo")) as saver:
        tid = uuid.uuid4()
        ck = empty_checkpoint()
        saver.put({"configurable": {"thread_id": tid, "checkpoint_ns": "child:1"}}, ck, {}, {})
        assert saver.get_tuple({"configurable": {"thread_id": str(tid), "checkpoint_ns": "child:1"}}) is not None
        assert saver.get_tuple({"configurable": {"thread_id": str(tid)}}) is None


def test_an_open_repo_holds_the_journal_beside_checkpoints(tmp_path):
    import luopan
    with luopan.open(str(tmp_path / "repo")) as repo:
        with LuopanSaver(repo) as saver:
            put_chain(saver, "t", 3)
        with LuopanSaver(repo) as saver:
            assert saver.get_tuple(cfg("t")) is not None
        assert os.path.isdir(journal_dir(str(tmp_path / "repo")))

"""Every kind visible (issue 31): ``luopan ls``, ``stats``, ``du``, ``show`` and the report list journals (a LangGraph
saver's threads and checkpoints, from a real graph), index snapshots (real FAISS) and artifacts with their own words
and sizes, alone and mixed with runs; ``du`` and ``stats`` agree on totals and dedup; an empty repository says so
instead of an infinite ratio."""

from __future__ import annotations

import json
import operator
from typing import Annotated, TypedDict

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.report import build_report

faiss = pytest.importorskip("faiss", reason="index snapshots need faiss (luopan[faiss])")
pytest.importorskip("langgraph.graph", reason="the LangGraph repository needs langgraph")

from langgraph.graph import END, START, StateGraph  # noqa: E402

from luopan.langgraph import LuopanSaver  # noqa: E402

THREADS, INVOKES = ("t1", "t2"), 3


class State(TypedDict):
    messages: Annotated[list, operator.add]
    n: int


def _graph_run(path) -> int:
    """A real StateGraph run on two threads with the saver; returns how many checkpoints LangGraph made."""
    g = StateGraph(State)
    g.add_node("step", lambda s: {"messages": ["reply " * 30 + str(s["n"])], "n": s["n"] + 1})
    g.add_edge(START, "step")
    g.add_edge("step", END)
    with LuopanSaver(str(path)) as saver:
        graph = g.compile(checkpointer=saver)
        for t in THREADS:
            for i in range(INVOKES):
                graph.invoke({"messages": [f"hi {i}"], "n": i}, {"configurable": {"thread_id": t}})
        return sum(len(list(saver.list({"configurable": {"thread_id": t}}))) for t in THREADS)


def _index(path) -> None:
    x = np.random.default_rng(0).standard_normal((400, 16)).astype(np.float32)
    with luopan.open(path, progress=False) as r:
        idx = r.index("kb")
        ix = faiss.IndexFlatL2(16)
        ix.add(x[:300])
        idx.snapshot(ix)
        ix.add(x[300:])
        idx.snapshot(ix)


def _artifact(path) -> None:
    with luopan.open(path, progress=False) as r:
        r.artifact("datasets/train").commit({"a.txt": b"row\n" * 3000})
        r.artifact("datasets/train").commit({"a.txt": b"row\n" * 3000, "b.txt": b"more\n" * 100})


def _checkpoints(path) -> None:
    w = np.random.default_rng(1).standard_normal(8192).astype(np.float32)
    with luopan.open(path, progress=False) as r:
        r.save("run-a", 1, {"w": w})
        r.save("run-a", 2, {"w": w, "b": np.ones(16, np.float32)})


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    made = {"langgraph": root / "lg", "index": root / "ix", "artifact": root / "ar", "mixed": root / "mix"}
    checkpoints = _graph_run(made["langgraph"])
    _index(made["index"])
    _artifact(made["artifact"])
    assert _graph_run(made["mixed"]) == checkpoints
    _index(made["mixed"])
    _artifact(made["mixed"])
    _checkpoints(made["mixed"])
    return {k: str(v) for k, v in made.items()}, checkpoints


def cli(*argv, code=0):
    res = CliRunner().invoke(app, [str(a) for a in argv], catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res


def as_json(*argv):
    return json.loads(cli(*argv, "--json").stdout)


# What each repository holds: (kind, name, words in `holds`)
EXPECTED = {
    "langgraph": [("journal", "langgraph", None)],
    "index": [("index", "kb", "2 versions")],
    "artifact": [("artifact", "datasets/train", "2 versions")],
}
EXPECTED["mixed"] = [*EXPECTED["artifact"], *EXPECTED["langgraph"], *EXPECTED["index"]]


@pytest.mark.parametrize("which", ["langgraph", "index", "artifact", "mixed"])
def test_ls_lists_every_kind_with_its_words_and_sizes(repos, which):
    paths, graph_checkpoints = repos
    path = paths[which]
    listing = as_json("ls", "-r", path)
    words = f"2 threads, {graph_checkpoints} checkpoints"
    for kind, name, holds in EXPECTED[which]:
        group = {"journal": "journals", "index": "indexes", "artifact": "artifacts"}[kind]
        (row,) = [x for x in listing[group] if x["name"] == name]
        assert row[{"journal": "journal", "index": "index", "artifact": "artifact"}[kind]] == name
        if kind == "journal":
            assert row["contents"] == {"threads": len(THREADS), "checkpoints": graph_checkpoints}
            assert row["type"] == "LangGraph journal" and row["log_bytes"] > 0 and words in row["holds"]
        else:
            assert row["holds"] == holds and row["logical_bytes"] > 0 and row["stored_bytes"] > 0
    assert [r["run"] for r in listing["runs"]] == (["run-a"] if which == "mixed" else [])
    text = cli("ls", "-r", path).stdout
    for kind, name, holds in EXPECTED[which]:
        line = next(x for x in text.splitlines() if f" {name} " in f" {x} ")
        assert (words if kind == "journal" else holds) in line and ("LangGraph journal" if kind == "journal"
                                                                    else kind) in line
        assert "KiB" in line  # its size
    assert "no checkpoints yet" not in text and "nothing stored" not in text


@pytest.mark.parametrize("which", ["langgraph", "index", "artifact", "mixed"])
def test_du_and_stats_agree_and_count_every_kind(repos, which):
    paths, graph_checkpoints = repos
    path = paths[which]
    du, st = as_json("du", "-r", path), as_json("stats", "-r", path)
    for key in ("logical_bytes", "stored_bytes", "chunks", "dedup_ratio"):
        assert du[key] == st[key] == st["repository"][key], key
    assert du["kinds"] == st["kinds"]
    kinds = {kind for kind, _n, _h in EXPECTED[which]} | ({"checkpoint"} if which == "mixed" else set())
    assert set(du["kinds"]) == kinds
    assert du["logical_bytes"] == sum(k["logical_bytes"] for k in du["kinds"].values())
    if "index" in kinds:
        assert du["indexes"] == 2 and du["kinds"]["index"]["stored_bytes"] > 0
    if "journal" in kinds:
        assert du["log_bytes"] == du["kinds"]["journal"]["log_bytes"] > 0
        assert du["manifest_bytes"] + du["log_bytes"] + du["pack_bytes"] + du["index_bytes"] + du["ref_bytes"] \
            == du["physical_bytes"]
    if du["stored_bytes"]:
        assert du["dedup_ratio"] == pytest.approx(du["logical_bytes"] / du["stored_bytes"], abs=1e-3)
        ratio = f"{du['dedup_ratio']:.1f}× dedup"
        assert ratio in cli("du", "-r", path).stdout and ratio in cli("stats", "-r", path).stdout
    else:  # LangGraph only: everything is in the journal's log, no chunk yet
        assert du["dedup_ratio"] is None
        for command in ("du", "stats"):
            text = cli(command, "-r", path).stdout
            assert "no dedup ratio" in text and "∞" not in text and "0 checkpoint(s)" not in text
            assert f"2 threads, {graph_checkpoints} checkpoints" in text and "logs " in text
    text = cli("stats", "-r", path).stdout
    for _kind, name, _holds in EXPECTED[which]:
        assert name in text
    if which == "index":
        assert "1 index (2 versions)" in text.splitlines()[0]


def test_show_gives_each_kind_in_its_words(repos):
    paths, graph_checkpoints = repos
    path = paths["mixed"]
    lg = as_json("show", "-r", path, "langgraph")
    assert lg["contents"] == {"threads": 2, "checkpoints": graph_checkpoints} and lg["log_bytes"] > 0
    assert lg["threads"] == {t: graph_checkpoints // len(THREADS) for t in THREADS}
    text = cli("show", "-r", path, "langgraph").stdout
    assert f"LangGraph journal langgraph: 2 threads, {graph_checkpoints} checkpoints" in text
    assert all(f"{t}  " in text for t in THREADS)  # one row per thread
    kb = as_json("show", "-r", path, "kb")
    assert [v["number"] for v in kb["versions"]] == [1, 2] and kb["versions"][1]["ntotal"] == 400
    text = cli("show", "-r", path, "kb@2").stdout
    assert "index kb: 2 versions" in text and "ntotal=400" in text and "ntotal=300" not in text
    art = as_json("show", "-r", path, "datasets/train@2")
    assert art["versions"][0]["parents"] == [] and art["versions"][0]["entries"] == 2
    assert "artifact datasets/train: 2 versions" in cli("show", "-r", path, "datasets/train").stdout
    assert as_json("show", "-r", path, "run-a@2")["step"] == 2  # a run is still a checkpoint
    assert "no version 9" in cli("show", "-r", path, "kb@9", code=4).output


@pytest.mark.parametrize("which", ["langgraph", "index", "artifact", "mixed"])
def test_the_report_lists_every_kind_with_sizes(repos, which, tmp_path):
    paths, graph_checkpoints = repos
    with luopan.open(paths[which], create=False) as r:
        page, data = build_report(r)
    assert "∞" not in page
    names = {(h["kind"], h["name"]) for h in data.holdings}
    assert names == {(k, n) for k, n, _h in EXPECTED[which]} | ({("checkpoint", "run-a")} if which == "mixed"
                                                                else set())
    assert 'class="holdings"' in page
    for kind, name, holds in EXPECTED[which]:
        assert f"<td>{name}</td>" in page
        assert (f"2 threads, {graph_checkpoints} checkpoints" if kind == "journal" else holds) in page
    if which == "langgraph":
        assert f"1 journal(s) (1 LangGraph: 2 thread(s), {graph_checkpoints} checkpoint(s))" in page
    summary = as_json("report", "-r", paths[which], "-o", tmp_path / "r.html")
    assert (summary["journals"], summary["indexes"]) == (int("journal" in {k for k, _n, _h in EXPECTED[which]}),
                                                         int(which in ("index", "mixed")))


def test_an_empty_repository_says_nothing_is_stored(tmp_path):
    luopan.open(tmp_path / "empty").close()
    assert "nothing stored yet" in cli("ls", "-r", tmp_path / "empty").stdout
    for command in ("du", "stats"):
        text = cli(command, "-r", tmp_path / "empty").stdout
        assert "nothing stored yet" in text and "∞" not in text and "—" not in text
    with luopan.open(tmp_path / "empty", create=False) as r:
        page, _data = build_report(r)
    assert "Nothing stored yet" in page and "∞" not in page


def test_a_same_step_save_that_writes_nothing_is_not_infinitely_smaller(tmp_path):
    """A report whose saves wrote no byte (each reused an earlier one's chunks) says so, not "∞ smaller"."""
    with luopan.open(tmp_path / "r", progress=False) as r:
        w = np.zeros(4096, np.float32)
        r.save("a", 1, {"w": w})
        r.delete("a", 1)
        r.save("a", 2, {"w": w})  # every chunk is already stored: written 0 B
        page, data = build_report(r, ["a"])
    assert "∞" not in page and "every byte reused from earlier saves" in page


def test_a_compacted_langgraph_journal_counts_its_snapshot_and_the_records_after(tmp_path):
    """Threads and checkpoints come from the journal's snapshot plus the records after it; a deleted thread is gone."""
    path = tmp_path / "lg"
    made = _graph_run(path)
    with LuopanSaver(str(path)) as saver:
        saver.delete_thread("t2")
        saver.compact()  # a snapshot of t1 only; the log segments it covers go
    g = StateGraph(State)
    g.add_node("step", lambda s: {"messages": ["again"], "n": s["n"] + 1})
    g.add_edge(START, "step")
    g.add_edge("step", END)
    with LuopanSaver(str(path)) as saver:
        g.compile(checkpointer=saver).invoke({"messages": ["x"], "n": 0}, {"configurable": {"thread_id": "t3"}})
        t3 = len(list(saver.list({"configurable": {"thread_id": "t3"}})))
    shown = as_json("show", "-r", path, "langgraph")
    assert shown["threads"] == {"t1": made // len(THREADS), "t3": t3}
    assert shown["manifests"] == 1 and shown["stored_bytes"] > 0  # the snapshot: a journal manifest with chunks
    listed = as_json("ls", "-r", path)["journals"][0]
    assert listed["contents"] == {"threads": 2, "checkpoints": made // len(THREADS) + t3}
    assert "1 snapshot" in listed["holds"]

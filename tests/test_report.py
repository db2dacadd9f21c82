"""``luopan report``: the self-contained HTML page of a known repository (charts counted through their data-*
attributes, hover titles, tables), the CLI's summary and errors, the report never writing into the repository, and
``--serve`` (fetched with urllib). The page in a real browser: tests/test_report_browser.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from html.parser import HTMLParser

import numpy as np
import pytest
from typer.testing import CliRunner

import luopan
from luopan.cli.main import app
from luopan.report import ReportServer, build_report, gather, write_report

from .conftest import PYTHON

runner = CliRunner()

# The known repository (make_repo): what each chart must hold.
RUN_A_STEPS = [100, 300, 400]  # 200 was deleted (pruned): its eval log keeps its metrics
RUN_B_STEPS = [0, 50]
PRUNED = 200
MANIFESTS = len(RUN_A_STEPS) + len(RUN_B_STEPS) + 2  # + datasets/raw@1, datasets/clean@1


def make_repo(path) -> str:
    """Two runs sharing a base table (cross-run dedup), metrics, eval logs, a pin, a pruned checkpoint, row deltas,
    and an artifact with a parent used as a checkpoint input."""
    repo = luopan.open(path, chunk_size=64 * 1024, delta_policy=luopan.DeltaPolicy(min_bytes=1 << 20))
    try:
        repo.artifact("datasets/raw").commit({"part-0.txt": b"raw rows\n" * 100})
        repo.artifact("datasets/clean").commit({"part-0.txt": b"clean rows\n" * 80}, parents=["datasets/raw@1"])
        rng = np.random.default_rng(0)
        emb = rng.standard_normal((2048, 128), dtype=np.float32)  # 1 MiB: a row-delta candidate
        base = emb.copy()
        for i, step in enumerate([100, 200, 300, 400]):
            if i:
                emb[rng.integers(0, 2048, 3)] += 1.0  # a few scattered rows change: a row delta
            repo.save("run-a", step, {"emb": emb, "bias": np.full(8, i, np.float32)},
                      metrics={"loss": 1.0 / (i + 1), "lr": 0.1}, inputs=["datasets/clean@1"])
        run = repo.run("run-a")
        run.log_eval(200, {"loss": 0.55, "acc": 0.7})
        run.log_eval(300, {"acc": 0.75})
        run.pin(300, tag="release-1")
        repo.delete("run-a", PRUNED)
        for i, step in enumerate(RUN_B_STEPS):  # starts from run-a's base table: its chunks are stored once
            repo.save("run-b", step, {"emb": base, "bias": np.full(8, 10 + i, np.float32)}, metrics={"loss": 0.9 - i / 10})
    finally:
        repo.close()
    return str(path)


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("report") / "repo")


class Collect(HTMLParser):
    """Start tags with their attributes, and the text of every <title> inside an SVG."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.titles: list[str] = []
        self._in_title = False
        self._svg = 0

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._svg += tag == "svg"
        self._in_title = tag == "title" and self._svg > 0

    def handle_endtag(self, tag):
        self._svg -= tag == "svg"
        self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.titles.append(data)

    def find(self, tag, **want):
        """Tags ``tag`` with every attribute wanted (``class_``: one of its classes; ``data_x``: ``data-x``)."""
        def ok(a):
            for k, v in want.items():
                if k == "class_":
                    if v not in a.get("class", "").split():
                        return False
                elif a.get(k.replace("_", "-")) != v:
                    return False
            return True
        return [a for t, a in self.tags if t == tag and ok(a)]


def parse(page: str) -> Collect:
    c = Collect()
    c.feed(page)
    return c


def manifest_stats(path, run, step):
    r = luopan.open(path, create=False)
    try:
        return r.manifest(run, step).doc
    finally:
        r.close()


def test_known_repository_has_what_the_charts_count(known):
    doc = manifest_stats(known, "run-a", 300)
    assert any("delta" in e for e in doc["entries"])  # the row delta the storage chart shows


def test_page_is_self_contained_and_counts_match(known):
    r = luopan.open(known, create=False)
    try:
        page, data = build_report(r)
    finally:
        r.close()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched from the network
    assert "<script" not in page  # a written page needs no script
    assert "@media (prefers-color-scheme: dark)" in page
    c = parse(page)
    loss_a = [a for t, a in c.tags if t == "circle" and "pt" in a.get("class", "").split()
              and a.get("data-run") == "run-a"]
    svg_loss = c.find("svg", data_chart="metric-loss", data_run="run-a")
    assert len(svg_loss) == 1
    # points per metric chart of run-a: loss at 100, 300, 400 and the pruned 200 (its eval log); acc at 200 and 300
    by_chart: dict[str, list[dict]] = {}
    chart = None
    for tag, a in c.tags:
        if tag == "svg":
            chart = (a.get("data-chart"), a.get("data-run"))
        elif tag == "circle" and "pt" in a.get("class", "").split():
            by_chart.setdefault(chart, []).append(a)
    assert sorted(int(a["data-step"]) for a in by_chart[("metric-loss", "run-a")]) == [100, 200, 300, 400]
    assert sorted(int(a["data-step"]) for a in by_chart[("metric-acc", "run-a")]) == [200, 300]
    assert len(by_chart[("metric-lr", "run-a")]) == 3
    assert sorted(int(a["data-step"]) for a in by_chart[("metric-loss", "run-b")]) == RUN_B_STEPS
    pruned = [a for a in by_chart[("metric-loss", "run-a")] if a["data-state"] == "pruned"]
    assert [int(a["data-step"]) for a in pruned] == [PRUNED] and "pruned" in pruned[0]["class"].split()
    states = {int(a["data-step"]): a["data-state"].split() for a in by_chart[("metric-loss", "run-a")]}
    assert "pinned" in states[300] and "latest" in states[400] and "best" in states[400]
    assert len(by_chart[("cumulative", None)]) == 2 * MANIFESTS  # written and full-save lines
    assert len(loss_a) > 0
    # storage: one written bar per checkpoint; a delta segment somewhere in run-a
    written = [a for a in c.find("rect", class_="bar") if a.get("data-part") == "written"]
    assert sorted((a["data-run"], int(a["data-step"])) for a in written) == sorted(
        [("run-a", s) for s in RUN_A_STEPS] + [("run-b", s) for s in RUN_B_STEPS])
    assert any(a.get("data-part") == "delta" and a["data-run"] == "run-a" for a in c.find("rect", class_="bar"))
    # tiers: every checkpoint and the pruned step
    cells = [a for a in c.find("rect", class_="cell")]
    assert sorted(int(a["data-step"]) for a in cells) == sorted(RUN_A_STEPS + [PRUNED] + RUN_B_STEPS)
    assert {a["data-tier"] for a in cells} == {"local", "pruned"}
    # dedup across runs: run-b reuses run-a's base table
    shared = c.find("rect", class_="bar", data_part="shared")
    assert any(a["data-series"] == "run-b" and a["data-from"] == "run-a" for a in shared)
    # lineage: raw -> clean -> run-a
    edges = {(a["data-from"], a["data-to"]) for a in c.find("path", class_="edge")}
    assert edges == {("datasets/raw@1", "datasets/clean@1"), ("datasets/clean@1", "run run-a")}
    # hover text names the checkpoint
    assert any(t.startswith("run-a step 300") and "pinned (release-1)" in t for t in c.titles)
    assert any(t.startswith("run-a step 200") and "pruned" in t for t in c.titles)
    # a text alternative (table) under every chart
    assert page.count("<svg class=\"chart") <= page.count('<details class="alt">')
    assert data.runs[0].name == "run-a" and list(data.runs[0].pruned) == [PRUNED]


def test_timings_read_when_recorded_else_not_recorded(known):
    page = build_report(luopan.open(known, create=False))[0]
    c = parse(page)
    for run, steps in (("run-a", RUN_A_STEPS), ("run-b", RUN_B_STEPS)):
        recorded = [s for s in steps if "save_us" in manifest_stats(known, run, s)["stats"]]
        bars = [a for a in c.find("rect", class_="bar", data_run=run) if a.get("data-part") == "save"]
        if recorded:  # stats.save_us is written by this luopan: one bar per recorded save
            assert sorted(int(a["data-step"]) for a in bars) == [s for s in recorded if
                                                                 manifest_stats(known, run, s)["stats"]["save_us"] > 0]
        else:
            assert not bars
            assert c.find("p", data_chart="timing", data_run=run)
    assert "not recorded" in page or all("save_us" in manifest_stats(known, r, s)["stats"]
                                         for r, ss in (("run-a", RUN_A_STEPS), ("run-b", RUN_B_STEPS)) for s in ss)


def test_timing_fields_and_restores_are_shown(known, monkeypatch):
    data = gather(luopan.open(known, create=False))
    for c in data.runs[0].checkpoints:  # as saved by a luopan that did not record them
        c.stats.pop("save_us", None)
        c.stats.pop("stall_us", None)
    c0 = data.runs[0].checkpoints[0]
    c0.stats["save_us"], c0.stats["stall_us"] = 1500000, 250000
    data.runs[0].resumes = [{"step": 300, "time": "2026-01-01T00:00:00+00:00", "restore_seconds": 0.4,
                             "matched": True, "first_divergent_step": None},
                            {"step": 400, "time": "2026-01-02T00:00:00+00:00", "restore_seconds": 0.5,
                             "matched": False, "first_divergent_step": 410}]
    from luopan.report import render
    c = parse(render(data))
    save = c.find("rect", class_="bar", data_run="run-a", data_part="save")
    stall = c.find("rect", class_="bar", data_run="run-a", data_part="stall")
    assert [a["data-step"] for a in save] == ["100"] and [a["data-step"] for a in stall] == ["100"]
    assert any(t == "run-a step 100 · save 1.50 s" for t in c.titles)
    assert any("training blocked 250 ms" in t for t in c.titles)
    assert len(c.find("svg", data_chart="restore", data_run="run-a")) == 1
    assert any("diverged at step 410" in t for t in c.titles)
    assert not c.find("svg", data_chart="restore", data_run="run-b")
    assert "2 checkpoint(s): not recorded." in render(data)


def test_selected_targets_and_unknown_names(known, tmp_path):
    r = luopan.open(known, create=False)
    try:
        data = gather(r, ["run-b", "datasets/clean"])
        assert [x.name for x in data.runs] == ["run-b"] and list(data.artifacts) == ["datasets/clean"]
        with pytest.raises(luopan.errors.ManifestNotFoundError):
            gather(r, ["nope"])
    finally:
        r.close()


def tree_state(path):
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def test_cli_writes_file_json_summary_and_never_touches_the_repository(known, tmp_path):
    before = tree_state(known)
    dest = tmp_path / "out" / "report.html"
    dest.parent.mkdir()
    res = runner.invoke(app, ["report", "-r", known, "-o", str(dest), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["path"] == str(dest) and dest.exists()
    assert (summary["runs"], summary["checkpoints"], summary["pruned"], summary["artifact_versions"]) == (2, 5, 1, 2)
    assert summary["charts"] >= 8 and summary["bytes"] == dest.stat().st_size
    assert tree_state(known) == before  # read only
    assert os.listdir(dest.parent) == ["report.html"]  # no temporary file left
    res = runner.invoke(app, ["-r", known, "report", "run-a", "-o", str(tmp_path / "a.html")])
    assert res.exit_code == 0 and "wrote" in res.output and "1 run(s)" in res.output


@pytest.mark.parametrize("args,code,text", [
    (["report", "-r", "{missing}", "-o", "{out}"], 4, "error:"),
    (["report", "-r", "{repo}", "nope", "-o", "{out}"], 4, "neither a run"),
    (["report", "-r", "{repo}", "-o", "{repo}/r.html"], 2, "inside the repository"),
    (["report", "-o", "{out}"], 2, "no repository given"),
])
def test_cli_errors_are_one_line(known, tmp_path, args, code, text):
    subst = {"missing": str(tmp_path / "missing"), "out": str(tmp_path / "x.html"), "repo": known}
    res = runner.invoke(app, [a.format(**subst) for a in args], env={"LUOPAN_REPO": ""})
    assert res.exit_code == code, res.output
    assert text in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not os.path.exists(os.path.join(known, "r.html"))


def fetch(url, timeout=20):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read().decode()


def test_server_in_a_thread_regenerates_per_request(known, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(known, copy)
    with ReportServer(lambda: luopan.open(copy, create=False), port=0).start() as server:
        assert server.url.startswith("http://127.0.0.1:")
        status, ctype, page = fetch(server.url)
        assert status == 200 and ctype.startswith("text/html") and "<script>" in page and "data-token" in page
        token = json.loads(fetch(server.url + "state")[2])["token"]
        repo = luopan.open(copy)
        repo.save("run-b", 60, {"bias": np.zeros(8, np.float32)}, metrics={"loss": 0.5})
        repo.close()
        assert json.loads(fetch(server.url + "state")[2])["token"] != token
        page = fetch(server.url)[2]
        assert 'data-step="60"' in page
        with pytest.raises(urllib.error.HTTPError):
            fetch(server.url + "nope")


def test_cli_serve_on_port_0_prints_url(known, child_env):
    proc = subprocess.Popen([PYTHON, "-m", "luopan.cli.main", "report", "-r", known, "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
        assert m, line + proc.stderr.read() if proc.poll() is not None else line
        status, _ctype, page = fetch(m.group(1))
        assert status == 200 and "run-a" in page and "luopan report" in page
    finally:
        proc.terminate()
        proc.wait(20)


def test_write_report_api(known, tmp_path):
    r = luopan.open(known, create=False)
    try:
        summary = write_report(r, tmp_path / "r.html", ["run-a"])
    finally:
        r.close()
    assert summary["runs"] == 1 and summary["pruned"] == 1
    assert oct(os.stat(tmp_path / "r.html").st_mode & 0o777) == oct(0o644)


def test_module_runs_as_script_entry(child_env):
    out = subprocess.run([sys.executable, "-m", "luopan.cli.main", "report", "--help"], capture_output=True, text=True,
                         env=child_env, timeout=60)
    assert out.returncode == 0 and "--serve" in out.stdout


def test_write_report_never_replaces_what_is_not_a_regular_file(known, tmp_path):
    """-o /dev/null (or a FIFO, a directory) is refused rather than replaced by a rename; through a symlink, the
    file it points at is written and the link stays."""
    repo = luopan.open(known, create=False)
    try:
        for bad in ("/dev/null", str(tmp_path)):
            with pytest.raises(luopan.UsageError, match="not a regular file"):
                write_report(repo, bad)
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(luopan.UsageError, match="not a regular file"):
            write_report(repo, tmp_path / "fifo")
        target = tmp_path / "real.html"
        target.write_text("old")
        (tmp_path / "link.html").symlink_to(target)
        write_report(repo, tmp_path / "link.html")
        assert (tmp_path / "link.html").is_symlink() and target.read_text().startswith("<!DOCTYPE html>")
    finally:
        repo.close()
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")

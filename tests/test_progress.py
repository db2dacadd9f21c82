"""Progress and logs of saves (luopan.checkpoint.progress): the `luopan` logger's record per save, the stderr line of a
long save, silence on request, CheckpointManager.last_save / on_save, and the timings in the manifest's stats."""

import logging
import math
import warnings

import numpy as np
import pytest
import torch

import luopan
from luopan.checkpoint import progress
from luopan.checkpoint.info import CheckpointInfo
from luopan.checkpoint.progress import SaveReport
from luopan.errors import CorruptManifestError
from luopan.format.manifest import Manifest, parse_manifest, seal_manifest
from luopan.policies import EveryNSteps
from luopan.torch import CheckpointManager, TrainingState


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture
def always(monkeypatch):
    """Every save counts as long (prints its line)."""
    monkeypatch.setattr(progress, "PROGRESS_AFTER", 0.0)


def test_one_log_record_per_committed_save(repo, caplog):
    caplog.set_level(logging.INFO, logger="luopan")
    repo.save("a", 1, {"w": np.ones(1000)})
    repo.save_async("a", 2, {"w": np.zeros(1000)}).wait()
    records = [r for r in caplog.records if hasattr(r, "luopan_save")]
    assert [r.luopan_save["step"] for r in records] == [1, 2]
    assert all(r.name == "luopan" and r.levelno == logging.INFO for r in records)
    first = records[0].luopan_save
    assert first["bytes_written"] == repo.checkpoints("a")[0].stored_bytes
    assert first["logical_bytes"] == 8000 and first["save_seconds"] == first["duration_seconds"] >= 0
    assert "run 'a' step 1 committed" in records[0].getMessage()


def test_short_saves_print_nothing(repo, capsys):
    repo.save("a", 1, {"w": np.ones(10)})
    repo.save_async("a", 2, {"w": np.ones(10)}).wait()
    assert capsys.readouterr().err == ""


def test_a_long_save_prints_one_line_when_not_a_terminal(repo, capsys, always):
    repo.save("a", 1, {"w": np.ones(1000)})
    repo.save_async("a", 2, {"w": np.ones(1000)}).wait()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("luopan: run 'a' step 1 committed:") and " in " in lines[0] and "stall" in lines[0]
    assert lines[1].startswith("luopan: run 'a' step 2 committed:")


def test_the_line_is_left_to_logging_when_it_shows_info(repo, capsys, caplog, always):
    caplog.set_level(logging.INFO, logger="luopan")
    repo.save("a", 1, {"w": np.ones(1000)})
    assert capsys.readouterr().err == ""
    assert sum(hasattr(r, "luopan_save") for r in caplog.records) == 1


def test_a_bar_on_a_terminal_for_a_synchronous_save(repo, monkeypatch, always):
    started = []
    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: True)
    real = progress.SaveProgress._start_bar
    monkeypatch.setattr(progress.SaveProgress, "_start_bar", lambda self: (started.append(self.step), real(self)))
    repo.save("a", 1, {"w": np.random.default_rng(0).random(300_000)})
    repo.save_async("a", 2, {"w": np.random.default_rng(1).random(300_000)}).wait()  # never a bar in the background
    assert started == [1]


def test_silent_on_request(repo_path, capsys, always):
    with luopan.open(repo_path, progress=False) as r:
        r.save("a", 1, {"w": np.ones(100)})
        r.save_async("a", 2, {"w": np.ones(100)}).wait()
    with luopan.open(repo_path) as r:
        r.save("a", 3, {"w": np.ones(100)}, progress=False)
        r.save_async("a", 4, {"w": np.ones(100)}, progress=False).wait()
        _model, state = _state()
        with CheckpointManager(r, "m", state, policy=EveryNSteps(1), progress=False, async_save=True) as mgr:
            mgr.maybe_save(1)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("async_save", [False, True])
def test_on_save_gets_each_committed_save(repo, async_save):
    model, state = _state()
    seen = []

    def on_save(report):
        assert report.step in repo.steps("run")  # committed before the callback runs
        seen.append(report)

    with CheckpointManager(repo, "run", state, policy=EveryNSteps(2), async_save=async_save, on_save=on_save) as mgr:
        assert mgr.last_save is None
        for step in range(1, 7):
            with torch.no_grad():
                model.weight.add_(0.01)
            mgr.maybe_save(step, {"loss": 1.0 / step})
        if async_save:
            mgr.close()  # the last background save is booked here
        assert mgr.last_save is seen[-1]
    assert [r.step for r in seen] == [2, 4, 6]
    infos = {i.step: i for i in repo.checkpoints("run")}
    for r in seen:
        info = infos[r.step]
        assert isinstance(r, SaveReport) and r.run == "run"
        assert r.bytes_written == info.stored_bytes and r.logical_bytes == info.logical_bytes
        assert r.new_bytes == info.new_bytes
        assert r.dedup_ratio == (info.logical_bytes / info.stored_bytes if info.stored_bytes else math.inf)
        assert r.save_seconds == r.duration_seconds == info.save_seconds > 0
        assert r.stall_seconds == info.stall_seconds
        assert 0 <= r.stall_seconds <= r.duration_seconds
        if not async_save:
            assert r.stall_seconds == r.duration_seconds
        d = r.as_dict()
        assert {"step", "stall_seconds", "duration_seconds", "save_seconds", "bytes_written", "dedup_ratio"} <= set(d)


def test_async_on_save_runs_on_the_loop_thread_once_committed(repo):
    model, state = _state()
    seen = []
    with CheckpointManager(repo, "run", state, policy=EveryNSteps(1), async_save=True,
                           on_save=lambda r: seen.append(r.step)) as mgr:
        handle = mgr.maybe_save(1)
        handle.wait()
        assert seen == []  # not from the background thread
        mgr.log(1, {"loss": 0.5})  # the loop's next call books it
        assert seen == [1] and mgr.last_save.step == 1


def test_a_raising_callback_warns_and_the_save_stands(repo, caplog):
    _model, state = _state()

    def boom(report):
        raise RuntimeError("logger down")

    with CheckpointManager(repo, "run", state, policy=EveryNSteps(1), on_save=boom) as mgr:
        with pytest.warns(UserWarning, match="on_save callback raised RuntimeError"):
            info = mgr.maybe_save(1)
        assert info.step == 1 and mgr.last_save.step == 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr.maybe_save(2)
    assert repo.steps("run") == [1, 2]
    assert any("on_save callback raised" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_manifest_stats_carry_save_and_stall_seconds(repo):
    repo.save("a", 1, {"w": np.ones(1000)})
    s = repo.manifest("a", 1).stats
    assert isinstance(s["save_us"], int) and s["save_us"] == s["stall_us"] >= 0
    big = {"w": np.random.default_rng(0).random(8 << 20).astype(np.float32)}  # 32 MiB: hashing outlasts the copy
    repo.save_async("a", 2, big).wait()
    s = repo.manifest("a", 2).stats
    assert 0 < s["stall_us"] < s["save_us"]
    info = repo.checkpoints("a")[1]
    assert (info.save_seconds, info.stall_seconds) == (s["save_us"] / 1e6, s["stall_us"] / 1e6)


def test_readers_accept_manifests_without_timings_and_refuse_bad_ones(repo):
    repo.save("a", 1, {"w": np.ones(10)})
    doc = dict(repo.manifest("a", 1).doc)
    doc.pop("checksum", None)
    for stats, ok in (({}, True), ({"save_us": 1500000, "stall_us": 250000}, True), ({"save_us": 3}, True),
                      ({"save_us": -1}, False), ({"stall_us": 1.5}, False), ({"save_us": 1 << 63}, False),
                      ({"save_us": "1.5"}, False)):
        base = {k: v for k, v in doc["stats"].items() if k not in ("save_us", "stall_us")}
        d = {**doc, "stats": {**base, **stats}}
        data = seal_manifest(d)
        if ok:
            m = parse_manifest(data, "sample")
            info = CheckpointInfo.from_manifest(m, "k")
            want = {k: (v / 1e6 if v is not None else None) for k, v in
                    (("save", stats.get("save_us")), ("stall", stats.get("stall_us")))}
            assert (info.save_seconds, info.stall_seconds) == (want["save"], want["stall"])
        else:
            with pytest.raises(CorruptManifestError, match="schema"):
                parse_manifest(data, "sample")
    old = SaveReport.from_info(CheckpointInfo.from_manifest(Manifest({**doc, "stats": base}), "k"))
    assert old.duration_seconds is None and old.stall_seconds is None and old.line().endswith(")")  # no timing


def test_a_save_that_writes_nothing_new_says_so_not_a_ratio_over_zero(repo, capsys, always):
    state = {"w": np.arange(1000, dtype=np.float32)}
    repo.save("r", 5, state)
    repo.save("r", 5, state, overwrite=True)  # the same state again: every chunk is already stored
    again = capsys.readouterr().err.splitlines()[-1]
    assert "nothing new written (all 1 chunk already stored, 3.9 KiB logical)" in again, again
    assert "0 B" not in again and "∞" not in again
    from typer.testing import CliRunner

    from luopan.cli.main import app

    shown = CliRunner().invoke(app, ["ls", "-r", str(repo.where), "r"])
    assert shown.exit_code == 0, shown.output
    assert "∞" not in shown.output and "all reused" in shown.output

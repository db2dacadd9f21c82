"""The headline test of luopan.torch: a run killed with SIGKILL and resumed is bitwise identical to one trained in
one go (parameters, optimizer state, RNG, and the per-step loss sequence)."""

import os
import subprocess

import pytest

import luopan
from luopan.tree import flatten

from .conftest import PYTHON

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
TOTAL = 20  # 12 batches per epoch: the kill at 13 or 16 is mid-epoch 2


def train(env, repo, losses, *args):
    r = subprocess.run([PYTHON, WORKER, str(repo), "run", str(TOTAL), str(losses), *args], env=env,
                       capture_output=True, text=True, timeout=300)
    return r


def read_losses(path):
    with open(path) as f:
        return [(int(s), float.fromhex(v)) for s, v in (line.split() for line in f)]


def assert_same_checkpoints(a, b):
    ta, tb = luopan.open(a).load("run", TOTAL), luopan.open(b).load("run", TOTAL)
    _, la = flatten(ta)
    _, lb = flatten(tb)
    assert [leaf.path for leaf in la] == [leaf.path for leaf in lb]
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, x.path
        assert bytes(x.host_bytes()) == bytes(y.host_bytes()), f"{x.path} differs"
    strip = lambda t: {k: v for k, v in t.items() if k != "extras"}  # noqa: E731
    assert flatten(strip(ta))[0] == flatten(strip(tb))[0]  # every JSON value too (scheduler, loader position, …)
    assert ta["extras"] == tb["extras"] == {"step": TOTAL}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, request):
    """Uninterrupted runs, one per training configuration (built lazily)."""
    cache = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.dirname(__file__)), "src")

    def get(*config):
        if config not in cache:
            d = tmp_path_factory.mktemp("baseline")
            r = train(env, d / "repo", d / "losses", *config)
            assert r.returncode == 0, r.stderr
            cache[config] = (d / "repo", read_losses(d / "losses"))
        return cache[config]

    return get


CASES = [
    pytest.param(("--kill-at", "13"), (), id="adamw-kill-mid-epoch"),
    pytest.param(("--kill-at", "16", "--workers", "2"), (), id="adamw-2-workers"),
    pytest.param(("--kill-at", "13", "--async"), ("--async",), id="adamw-kill-during-async-save"),
    pytest.param(("--kill-at", "14", "--optim", "sgd"), ("--optim", "sgd"), id="sgd-momentum"),
    pytest.param(("--kill-at", "13", "--amp"), ("--amp",), id="amp-gradscaler-cpu"),
]


@pytest.mark.parametrize("kill_args, config", CASES)
def test_killed_and_resumed_run_is_bitwise_identical(tmp_path, child_env, baselines, kill_args, config):
    base_repo, base_losses = baselines(*config)
    assert len(base_losses) == TOTAL
    repo, losses = tmp_path / "repo", tmp_path / "losses"
    first = train(child_env, repo, losses, *kill_args)
    assert first.returncode == -9, first.stderr  # SIGKILL
    killed_at = int(kill_args[1])
    steps = luopan.open(repo).steps("run")
    assert steps and max(steps) <= killed_at and killed_at not in steps or "--async" in kill_args

    second = train(child_env, repo, losses, *[a for a in kill_args if a not in ("--kill-at", kill_args[1])])
    assert second.returncode == 0, second.stderr
    restored = int(second.stdout.split("RESTORED ")[1].split()[0])
    assert 0 < restored <= killed_at
    # Loss per step: the killed run's up to the restored step, then the resumed run's.
    got = read_losses(losses)
    first_part = [x for x in got[:killed_at] if x[0] <= restored]
    resumed = got[killed_at:]
    assert [s for s, _ in first_part + resumed] == list(range(1, TOTAL + 1))
    assert first_part + resumed == base_losses  # bitwise: float.hex round trip
    assert_same_checkpoints(base_repo, repo)


def test_leaving_the_rng_out_breaks_resumption(tmp_path, child_env, baselines):
    """Guard against a vacuous pass: the same kill and resume without the RNG states must differ from the
    uninterrupted run (dropout and the loss weights draw from them), so the test above can fail."""
    _base_repo, base_losses = baselines()
    repo, losses = tmp_path / "repo", tmp_path / "losses"
    assert train(child_env, repo, losses, "--kill-at", "13", "--no-rng").returncode == -9
    r = train(child_env, repo, losses, "--no-rng")
    assert r.returncode == 0, r.stderr
    restored = int(r.stdout.split("RESTORED ")[1].split()[0])
    got = read_losses(losses)
    combined = [x for x in got[:13] if x[0] <= restored] + got[13:]
    assert [s for s, _ in combined] == list(range(1, TOTAL + 1))
    assert combined[:restored] == base_losses[:restored]  # identical until the resume
    assert combined[restored:] != base_losses[restored:]  # then the random streams diverge

"""Live weight sync across processes and crashes (docs/format.md §19.3): a trainer process publishes 20 steps and a
second process's model is bit-equal to the trainer's after every one — across a restart of the subscriber (a fresh
model: full version + one delta) and a publisher SIGKILLed mid-publish (the subscriber keeps the last good version;
a restarted publisher carries on). The publish write path under simulated power loss (tests/powerloss.py): every
crash state leaves an index that a subscriber accepts and applies exactly, of the old or — once acknowledged — the
new version."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

import luopan.sync
from luopan.errors import ChannelDownloadError
from luopan.signing import generate_key

from .crashstates import CrashState, check_crash_states
from .powerloss import Recorder
from .test_sync import bits, make_model, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Proc:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
        self.p = subprocess.Popen([sys.executable, "-m", "tests.sync_worker", *args], cwd=ROOT, env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> list[str]:
        assert self.p.stdin and self.p.stdout
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().split()
        assert out, f"the process died (exit {self.p.poll()}) on {line!r}"
        return out

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def test_a_second_process_follows_20_steps_through_restart_and_a_killed_publish(tmp_path):
    key, pub = generate_key(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(pub, trusted / "k.pub")
    ch, state = str(tmp_path / "ch"), str(tmp_path / "worker.state")
    trainer, worker = Proc("trainer", ch, str(key)), Proc("worker", ch, str(trusted), state)
    try:
        step, version, good = 0, 0, ""
        for step in range(20):
            if step == 8:  # restart the subscriber: a fresh process and model, the state file kept
                worker.stop()
                worker = Proc("worker", ch, str(trusted), state)
            if step == 14:  # SIGKILL the publisher after its files, before its index
                assert trainer.ask(f"stall {step}") == ["stalled"]
                os.kill(trainer.p.pid, signal.SIGKILL)
                trainer.stop()
                held = worker.ask("update")
                assert held == ["updated", "None", good]  # the last good version, untouched
                trainer = Proc("trainer", ch, str(key))  # a restarted trainer: replays to where it was
                assert trainer.ask(f"replay {step}") == ["ok"]
            _, v, want = trainer.ask(f"step {step}")
            assert int(v) == version + 1
            version = int(v)
            assert worker.ask("update") == ["updated", v, want], f"step {step}"
            good = want
            assert worker.ask("update") == ["updated", "None", want]
        assert version == 20
    finally:
        trainer.stop()
        worker.stop()


# -------------------------------------------------------------------------------------------------- power loss

def _check_state(versions: dict[int, dict[str, bytes]], held: dict, acked: str):
    def check(state: CrashState) -> None:
        ch = os.path.join(state.root, "ch")
        worker = make_model(1)
        if held:
            worker.load_state_dict(held)
        try:
            applied = luopan.sync.Subscriber(ch).update(worker)
        except ChannelDownloadError:  # no index yet: nothing was published
            assert acked not in state.acks, state.describe()
            return
        got = bits(worker)
        match = [v for v, b in versions.items() if b == got]
        assert match, f"the worker holds no published version: {state.describe()}"
        if acked in state.acks:
            assert max(match) == max(versions) and applied in (max(versions), None), state.describe()
        # the channel keeps working: a Publisher reopened there publishes and a subscriber follows
        if state.point % 9 == 0:
            trainer = make_model(0)
            pub = luopan.sync.Publisher(ch)
            pub.publish(99, trainer)
            luopan.sync.Subscriber(ch).update(worker)
            assert bits(worker) == bits(trainer)
            assert not [n for d in ("full", "deltas", "") for n in os.listdir(os.path.join(ch, d)) if ".tmp-" in n]
    return check


@pytest.mark.parametrize("first", [False, True])
def test_power_loss_during_publish(tmp_path, first):
    world = tmp_path / "w"
    world.mkdir()
    trainer = make_model(0)
    versions: dict[int, dict[str, bytes]] = {}
    held: dict = {}
    pub = None
    if not first:
        pub = luopan.sync.Publisher(world / "ch", keep=2)
        for step in range(3):
            train_step(trainer, step)
            versions[pub.publish(step, trainer)] = bits(trainer)
        held = {k: v.detach().clone() for k, v in trainer.state_dict().items()}
    train_step(trainer, 3)
    new = bits(trainer)

    with Recorder(world) as rec:
        p = pub or luopan.sync.Publisher(world / "ch", keep=2)
        v = p.publish(3, trainer)
        rec.ack("published")
        p.wait()  # the removal of the files no index names runs after publish returns: record it too
    versions[v] = new
    assert any(e.kind == "fsync" for e in rec.events)
    assert check_crash_states(rec, tmp_path, _check_state(versions, held, "published")) > 10

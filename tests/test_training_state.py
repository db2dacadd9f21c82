"""luopan.torch: TrainingState capture/restore and its checks, ResumableLoader, CheckpointManager."""

import os
import random

import numpy as np
import pytest
import torch

import luopan
from luopan.policies import EveryNSteps
from luopan.torch import CheckpointManager, ResumableLoader, TrainingState


def setup(hidden=8, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def step(model, opt, sched):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def test_round_trip_of_every_part(repo):
    model, opt, sched = setup()
    npg, rs, tg = np.random.default_rng(1), np.random.RandomState(2), torch.Generator().manual_seed(3)
    loader = ResumableLoader(list(range(10)), batch_size=3, seed=4)
    extras = {"epoch": 2, "best": 0.5, "tags": ["a"]}
    state = TrainingState(model=model, optimizer=opt, scheduler=sched, loader=loader, extras=extras,
                          generators={"np": npg, "rs": rs, "torch": tg})
    for _ in range(3):
        step(model, opt, sched)
    it = iter(loader)
    next(it)
    random.seed(11)
    np.random.seed(12)
    repo.save("r", 3, state.capture(), metadata=state.metadata())
    expected = {
        "params": [p.detach().clone() for p in model.parameters()], "lr": sched.get_last_lr(),
        "python": random.random(), "numpy": np.random.rand(), "torch": torch.rand(1), "npg": npg.random(),
        "rs": rs.rand(), "tg": torch.rand(1, generator=tg), "batch": next(it),
    }
    model2, opt2, sched2 = setup(seed=1)
    npg2, rs2, tg2 = np.random.default_rng(9), np.random.RandomState(9), torch.Generator().manual_seed(9)
    loader2 = ResumableLoader(list(range(10)), batch_size=3, seed=4)
    extras2 = {}
    state2 = TrainingState(model=model2, optimizer=opt2, scheduler=sched2, loader=loader2, extras=extras2,
                           generators={"np": npg2, "rs": rs2, "torch": tg2})
    m = repo.manifest("r", 3)
    state2.restore(repo.load("r", 3), m.doc["metadata"])
    assert all(torch.equal(a, b) for a, b in zip(expected["params"], model2.parameters()))
    assert sched2.get_last_lr() == expected["lr"] and extras2 == extras
    assert random.random() == expected["python"] and np.random.rand() == expected["numpy"]
    assert torch.equal(torch.rand(1), expected["torch"])
    assert npg2.random() == expected["npg"] and rs2.rand() == expected["rs"]
    assert torch.equal(torch.rand(1, generator=tg2), expected["tg"])
    assert torch.equal(next(iter(loader2)), expected["batch"])  # resumes after the batch already consumed
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_mismatches_are_all_listed_before_anything_changes(repo):
    model, opt, sched = setup()
    step(model, opt, sched)
    repo.save("r", 1, TrainingState(model=model, optimizer=opt, scheduler=sched).capture())
    bigger, opt2, sched2 = setup(hidden=16, seed=5)
    before = [p.detach().clone() for p in bigger.parameters()]
    state = TrainingState(model=bigger, optimizer=opt2, scheduler=sched2, extra_thing=ResumableLoader([1, 2]))
    with pytest.raises(luopan.StateMismatchError) as ei:
        state.restore(repo.load("r", 1), where="run 'r' step 1")
    msg = str(ei.value)
    assert "model: '0.weight': checkpoint has float32(8, 4), model has float32(16, 4)" in msg
    assert "model: '2.weight': checkpoint has float32(2, 8), model has float32(2, 16)" in msg
    assert "component 'extra_thing' is not in run 'r' step 1" in msg
    assert "optimizer: state[0]['exp_avg'] has shape (8, 4), its parameter (16, 4)" in msg
    assert "strict=False" in msg
    assert all(torch.equal(a, b) for a, b in zip(before, bigger.parameters()))  # nothing touched


def test_strict_false_restores_what_both_sides_have(repo):
    model, opt, sched = setup()
    repo.save("r", 1, TrainingState(model=model, optimizer=opt).capture())
    model2, _, _ = setup(seed=3)
    loader = ResumableLoader([1, 2, 3])
    TrainingState(model=model2, loader=loader).restore(repo.load("r", 1), strict=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_unexpected_component_and_optimizer_groups(repo):
    model, opt, sched = setup()
    repo.save("r", 1, TrainingState(model=model, optimizer=opt, scheduler=sched).capture())
    m2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.SGD([{"params": [m2.weight]}, {"params": [m2.bias]}], lr=0.1)
    with pytest.raises(luopan.StateMismatchError) as ei:
        TrainingState(model=model, optimizer=opt2).restore(repo.load("r", 1))
    assert "has component 'scheduler', which this TrainingState lacks" in str(ei.value)
    assert "checkpoint has 1 parameter groups, the optimizer 2" in str(ei.value)


def test_different_world_size_is_refused_and_torch_version_warns(repo):
    model, opt, _ = setup()
    state = TrainingState(model=model, layout="dp=1")
    meta = state.metadata()
    meta["luopan.torch"]["world_size"] = 8
    with pytest.raises(luopan.LayoutMismatchError, match="world_size: saved with 8, now 1"):
        state.restore(state.capture(), meta)
    meta = state.metadata()
    meta["luopan.torch"]["layout"] = "fsdp=4,tp=2"
    with pytest.raises(luopan.LayoutMismatchError, match="layout: saved with 'fsdp=4,tp=2', now 'dp=1'"):
        state.restore(state.capture(), meta)
    meta = state.metadata()
    meta["luopan.torch"]["torch"] = "1.13.1"
    with pytest.warns(UserWarning, match=r"saved with torch 1\.13\.1; this is torch"):
        state.restore(state.capture(), meta)


def test_bad_components_are_refused():
    with pytest.raises(luopan.UnsupportedValueError, match="has no state_dict"):
        TrainingState(thing=object())
    with pytest.raises(luopan.UnsupportedValueError, match="pass numpy Generator/RandomState or torch.Generator"):
        TrainingState(generators={"g": random.Random(0)})


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch_with_the_same_order(workers):
    data = list(range(23))
    a = ResumableLoader(data, batch_size=4, seed=3, num_workers=workers)
    first_epoch = [b.tolist() for b in a]
    assert sorted(sum(first_epoch, [])) == data and first_epoch != [data[i:i + 4] for i in range(0, 23, 4)]
    it = iter(a)
    taken = [next(it).tolist() for _ in range(3)]
    saved = a.state_dict()
    assert saved["epoch"] == 1 and saved["batches"] == 3
    rest = [b.tolist() for b in it]
    b = ResumableLoader(data, batch_size=4, seed=3, num_workers=workers)
    b.load_state_dict(saved)
    assert [x.tolist() for x in b] == rest
    assert b.state_dict()["epoch"] == 2 and b.state_dict()["batches"] == 0
    assert len(taken) + len(rest) == len(a) == 6


def test_loader_refuses_a_state_it_cannot_resume():
    a = ResumableLoader(list(range(10)), batch_size=2, seed=1)
    b = ResumableLoader(list(range(12)), batch_size=3, seed=1)
    with pytest.raises(luopan.StateMismatchError, match="batch_size: checkpoint has 2, this loader has 3"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="chooses the sampler"):
        ResumableLoader([1], sampler=[0])


def test_manager_restores_saves_by_policy_and_checks(tmp_path):
    model, opt, sched = setup()
    state = TrainingState(model=model, optimizer=opt, scheduler=sched)
    mgr = CheckpointManager(tmp_path / "r", "run", state, policy=EveryNSteps(2), verify_every=1)
    assert mgr.restore() == 0
    saved = [s for s in range(1, 6) if (step(model, opt, sched) or mgr.maybe_save(s, {"loss": 1.0}))]
    assert saved == [2, 4] and mgr.repo.steps("run") == [2, 4]
    assert mgr.repo.manifest("run", 4).doc["metadata"]["luopan.reason"].startswith("every 2")
    mgr.close()
    model2, opt2, sched2 = setup(seed=9)
    mgr2 = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model2, optimizer=opt2, scheduler=sched2))
    assert mgr2.restore() == 4
    mgr2.close()


def test_post_save_check_catches_a_damaged_pack_and_read_back_a_changed_value(tmp_path):
    model, opt, sched = setup()
    mgr = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), verify_every=1, verify_sample=100)
    mgr.save(1)
    m = mgr.repo.manifest("run", 1)
    pack = os.path.join(tmp_path, "r", "packs", m.packs[0][:2], m.packs[0] + ".pack")
    tree = mgr.state.capture()
    with torch.no_grad():
        model[0].weight[0, 0] += 1  # the live value no longer matches what was saved
    with pytest.raises(luopan.IntegrityError, match="reads back different bytes"):
        mgr._check_saved(1, tree)
    with open(pack, "r+b") as f:
        f.truncate(os.path.getsize(pack) - 1)
    with pytest.raises(luopan.IntegrityError, match="post-save check"):
        mgr._check_saved(1, None)
    mgr.close()


def test_async_manager_flushes_on_close(tmp_path):
    model, opt, sched = setup()
    mgr = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=EveryNSteps(1),
                            async_save=True)
    handle = mgr.maybe_save(1)
    assert isinstance(handle, luopan.SaveHandle)
    mgr.close()
    assert luopan.open(tmp_path / "r").steps("run") == [1]


def test_checkpointing_does_not_touch_the_global_rngs(tmp_path):
    def draws():
        return torch.rand(2).tolist(), random.random(), np.random.rand()

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = draws()
    model, opt, sched = setup()
    mgr = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=EveryNSteps(1),
                            verify_every=1)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    mgr.maybe_save(1)  # save, post-save check and sampled read-back
    assert draws() == expected
    mgr.close()


def test_policy_memory_survives_a_resume(tmp_path):
    from luopan.policies import LossSpike

    model, opt, sched = setup()
    policy = EveryNSteps(5) | LossSpike(window=20, min_history=3)
    mgr = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=policy)
    for s in range(1, 11):
        mgr.maybe_save(s, {"loss": 1.0 + 0.01 * s})
    saved = policy.state_dict()
    mgr.close()
    fresh = EveryNSteps(5) | LossSpike(window=20, min_history=3)
    mgr2 = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=fresh)
    assert mgr2.restore() == 10
    assert fresh.state_dict() == saved
    mgr2.close()
    other = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=EveryNSteps(7))
    with pytest.warns(UserWarning, match="save policy's state was not restored"):
        other.restore()
    other.close()


def test_a_failed_async_save_is_not_booked_as_saved():
    from .test_commit_failures import FaultyStore

    store = FaultyStore()
    model, opt, sched = setup()
    mgr = CheckpointManager(luopan.open(store), "run", TrainingState(model=model), policy=EveryNSteps(1),
                            async_save=True)
    mgr.maybe_save(1)
    mgr._finish_pending()
    assert mgr.last_saved_step == 1
    store.prefix = "packs/"
    with torch.no_grad():
        model[0].weight.add_(1)
    mgr.maybe_save(2)  # fails in the background
    with pytest.raises(OSError, match="injected I/O error"):
        mgr.maybe_save(3)  # the failure surfaces here, before anything else happens
    assert mgr.last_saved_step == 1 and mgr.saves == 1
    store.prefix = None
    mgr.maybe_save(3)
    mgr.close()
    assert mgr.last_saved_step == 3 and mgr.repo.steps("run") == [1, 3]


def test_optimizer_state_of_other_shapes_is_not_refused(repo):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)  # row/column variances: not the parameter's shape
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    repo.save("r", 1, TrainingState(model=model, optimizer=opt).capture())
    model2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.Adafactor(model2.parameters(), lr=1e-2)
    TrainingState(model=model2, optimizer=opt2).restore(repo.load("r", 1))
    assert torch.equal(opt2.state_dict()["state"][0]["row_var"], opt.state_dict()["state"][0]["row_var"])


def test_manager_applies_retention_after_each_save(tmp_path):
    from luopan.retention import KeepLast

    model, opt, sched = setup()
    mgr = CheckpointManager(tmp_path / "r", "run", TrainingState(model=model), policy=EveryNSteps(1),
                            retention=KeepLast(2))
    mgr.maybe_save(1)
    mgr.repo.run("run").pin(1)
    for s in range(2, 6):
        mgr.maybe_save(s)
    assert mgr.repo.steps("run") == [1, 4, 5]  # the pinned one and the last two
    assert mgr.last_prune.remove == [3]
    mgr.close()

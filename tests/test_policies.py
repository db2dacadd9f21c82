"""Save policies (luopan.policies): triggering steps on hand-made sequences, with injected clocks."""

import json
import math
import random

import pytest

from luopan.policies import AnyOf, EveryNSteps, EveryTSeconds, LossSpike, Phased, SavePolicy, YoungDaly


def drive(policy, losses=None, *, steps=None, times=None, cost_s=1.0, start=1):
    """Play a fake manager: ask every step, report every save. Returns {step: reason} of the saves."""
    n = len(losses) if losses is not None else (steps if steps is not None else len(times))
    saves = {}
    for i in range(n):
        step = start + i
        metrics = {} if losses is None or losses[i] is None else {"loss": losses[i]}
        now = float(times[i]) if times is not None else float(step)
        reason = policy.should_save(step, metrics, now)
        if reason:
            saves[step] = reason
            policy.saved(step, now, cost_s)
    return saves


def roundtrip(policy, fresh):
    """state_dict through JSON (NaN refused) into a freshly configured policy."""
    fresh.load_state_dict(json.loads(json.dumps(policy.state_dict(), allow_nan=False)))
    return fresh


# --- EveryNSteps / EveryTSeconds --------------------------------------------------------------------------------


def test_every_n_steps():
    p = EveryNSteps(3)
    assert [s for s in range(0, 11) if p.should_save(s, {}, 0.0)] == [3, 6, 9]
    assert p.should_save(6, {}, 0.0) == "every 3 steps"


def test_every_t_seconds_counts_from_first_call_and_last_save():
    p = EveryTSeconds(10)
    saves = drive(p, times=[100, 105, 109.9, 110, 115, 119.9, 120, 125])
    assert list(saves) == [4, 7]  # t=110 (10 s after the first call), t=120
    assert saves[4] == "every 10s"
    # a save caused by someone else restarts the clock
    p = EveryTSeconds(10)
    assert p.should_save(1, {}, 0.0) is None
    p.saved(1, 8.0, 0.5)
    assert p.should_save(2, {}, 17.0) is None
    assert p.should_save(3, {}, 18.0)


def test_every_t_seconds_firing_counts_as_a_save_without_saved():
    p = EveryTSeconds(10)
    fired = [t for t in range(0, 35) if p.should_save(t, {}, float(t))]  # never told `saved`
    assert fired == [10, 20, 30]


# --- composition ------------------------------------------------------------------------------------------------


def test_or_builds_flat_anyof_and_returns_first_reason():
    a, b, c = EveryNSteps(4), EveryNSteps(6), EveryTSeconds(1000)
    p = a | b | c
    assert isinstance(p, AnyOf) and isinstance(p, SavePolicy)
    assert p.policies == (a, b, c)
    assert repr(p) == "EveryNSteps(4) | EveryNSteps(6) | EveryTSeconds(1000)"
    saves = drive(p, steps=12)
    assert saves == {4: "every 4 steps", 6: "every 6 steps", 8: "every 4 steps", 12: "every 4 steps"}
    assert "every 4 steps; or every 6 steps; or every 16m40s" == p.describe()


def test_anyof_asks_everyone_every_step_and_forwards_saved():
    spike, timer = LossSpike(window=5, min_history=2), EveryTSeconds(10)
    p = AnyOf(EveryNSteps(1), spike, timer)  # the first fires every step; the others must still observe
    saves = drive(p, [1.0] * 5, times=[0, 3, 6, 9, 12])
    assert set(saves.values()) == {"every 1 steps"}
    assert spike.state_dict()["values"] == [1.0] * 5
    # saved() reached the timer at every step, so its 10 s never ran out
    assert timer.state_dict()["elapsed_s"] == 0.0
    assert p.should_save(6, {"loss": 9.0}, 21.0) == "every 1 steps"  # spike fired too, but reported second


def test_anyof_rejects_non_policies():
    with pytest.raises(ValueError, match="at least one policy"):
        AnyOf()
    with pytest.raises(TypeError, match="SavePolicy objects"):
        AnyOf(EveryNSteps(2), 5)
    with pytest.raises(TypeError):
        EveryNSteps(2) | 5


# --- Phased -----------------------------------------------------------------------------------------------------


def test_phased_by_step():
    p = Phased(5, 20, switch_at_step=30)
    saves = drive(p, steps=80)
    assert list(saves) == [5, 10, 15, 20, 25, 40, 60, 80]
    assert saves[5] == "every 5 steps (until step 30)"
    assert saves[40] == "every 20 steps (from step 30)"
    assert p.phase == "late" and p.interval == 20


def decaying_then_flat(n, seed=0):
    """1 + 4 exp(-t/50) with ±2% deterministic noise: falls fast, flat after a few hundred steps."""
    rng = random.Random(seed)
    return [(1 + 4 * math.exp(-t / 50)) * (1 + rng.uniform(-0.02, 0.02)) for t in range(1, n + 1)]


def test_phased_switches_once_the_loss_flattens_and_stays():
    p = Phased(5, 20, window=20, flat_below=0.01)
    losses = decaying_then_flat(1000)
    saves = drive(p, losses)
    assert p.phase == "late"
    switch = p.state_dict()["since"]
    # windows 20 values apart improve (1 - e^-0.4) * 4e^(-t/50) / (1 + ...): below 1% once t is about 245
    assert 220 < switch < 300
    assert all(s % 5 == 0 for s in saves if s < switch)
    assert [s for s in saves if s >= switch] == [s for s in range(switch, 1001) if s % 20 == 0]  # no flapping
    assert saves[40] == "every 5 steps (loss still falling)"
    assert saves[1000] == f"every 20 steps (loss flat since step {switch})"


def test_phased_goes_back_to_dense_only_when_the_loss_rises():
    p = Phased(5, 20, window=20, flat_below=0.01, rise_above=0.05)
    drive(p, decaying_then_flat(600))
    assert p.phase == "late"
    drive(p, [0.5] * 200, start=601)  # falls again (a learning-rate drop): stays sparse
    assert p.phase == "late"
    phases = {}
    for step in range(801, 861):  # rises 60% over the best window mean, then stays at 0.8
        reason = p.should_save(step, {"loss": 0.8}, float(step))
        phases[step] = p.phase
        if step == 805:
            assert reason == "every 5 steps (loss rose at step 802)"
    assert phases[801] == "late" and phases[802] == "early"  # recent mean (18 x 0.5 + 2 x 0.8) / 20 > 0.5 x 1.05
    assert phases[839] == "early" and phases[840] == "late"  # both windows all 0.8: flat at the new level


def test_phased_ignores_missing_and_non_finite_values():
    p = Phased(5, 20, window=3)
    drive(p, [1.0, None, float("nan"), 1.0, float("inf"), 1.0, "x", 1.0, 1.0, 1.0])
    assert p.state_dict()["values"] == [1.0] * 6 and p.phase == "late"  # flat: exactly no improvement


# --- LossSpike --------------------------------------------------------------------------------------------------


def test_loss_spike_fires_on_factor_times_moving_mean_with_cooldown():
    p = LossSpike(factor=2.0, window=10, min_history=5, cooldown=5)
    losses = [1.0] * 10 + [2.0, 3.2, 3.2, 3.2] + [1.0] * 5 + [5.0] + [1.0] * 5 + [5.0]
    saves = drive(p, losses)
    assert saves == {
        12: "loss spike: 3.2 > 2 x moving mean 1.1",  # 2.0 is not above 2 x 1.0; 3.2 > 2 x 1.1
        20: "loss spike: 5 > 2 x moving mean 1.76",   # 8 steps after 12: cooled down; spike values are in the mean
        26: "loss spike: 5 > 2 x moving mean 1.4",
    }


def test_loss_spike_cooldown_suppresses_a_second_spike():
    p = LossSpike(factor=2.0, window=10, min_history=5, cooldown=10)
    saves = drive(p, [1.0] * 10 + [5.0, 1.0, 1.0, 5.0] + [1.0] * 6 + [5.0])
    assert list(saves) == [11, 21]  # step 14 is within 10 steps of 11


def test_loss_spike_needs_min_history_and_absorbs_a_new_level():
    p = LossSpike(factor=2.0, window=10, min_history=5, cooldown=0)
    assert drive(p, [1.0] * 4 + [9.0]) == {}  # 4 values are not enough history
    p = LossSpike(factor=2.0, window=10, min_history=5, cooldown=0)
    saves = drive(p, [1.0] * 10 + [3.0] * 10)
    assert 11 in saves and 20 not in saves  # a lasting jump enters the window and stops being a spike


def test_loss_spike_non_finite_fires_once_per_run_and_stays_out_of_the_window():
    p = LossSpike(window=10, min_history=5, cooldown=3)
    nan, inf = float("nan"), float("inf")
    saves = drive(p, [1.0] * 6 + [nan, nan, nan, inf, 1.0, 1.0, 1.0, 1.0, nan])
    assert list(saves) == [7, 15]
    assert saves[7].startswith("loss is nan: saved for inspection; the state may already be diverged")
    assert p.state_dict()["values"] == [1.0] * 10
    json.dumps(p.state_dict(), allow_nan=False)
    assert LossSpike().should_save(1, {"loss": nan}, 0.0)  # no history needed to flag a NaN


def test_loss_spike_ignores_missing_and_odd_metrics():
    p = LossSpike(window=5, min_history=1, cooldown=0)
    for i, m in enumerate([{}, None, {"loss": "high"}, {"acc": 9.0}, {"loss": None}], 1):
        assert p.should_save(i, m, 0.0) is None
    assert p.state_dict()["values"] == []
    p = LossSpike(window=5, min_history=1, metric="val_loss")
    drive(p, [1.0, 9.0])
    assert p.state_dict()["values"] == []  # watches val_loss only


# --- YoungDaly --------------------------------------------------------------------------------------------------


def test_young_daly_interval_hand_computed():
    p = YoungDaly(24 * 3600, initial_cost_s=4.0)
    assert p.cost_s == 4.0
    assert p.interval_s == pytest.approx(math.sqrt(2 * 4 * 86400)) == pytest.approx(831.38, abs=0.01)
    assert p.should_save(1, {}, 1000.0) is None  # the first call starts the clock
    assert p.should_save(2, {}, 1831.0) is None
    assert p.should_save(3, {}, 1832.0) == "young-daly: every 13m51s (C=4s, MTBF 24h)"
    assert p.should_save(4, {}, 1900.0) is None


def test_young_daly_overhead_cap_and_bounds():
    # C=60 s, MTBF 1 h: sqrt(2*60*3600) = 657 s would spend 9% on saves; 5% needs 60 / 0.05 = 1200 s
    p = YoungDaly(3600, initial_cost_s=60.0, max_overhead=0.05)
    assert p.interval_s == pytest.approx(1200.0)
    assert p.cost_s / p.interval_s <= 0.05
    assert YoungDaly(3600, initial_cost_s=60.0, max_overhead=0.2).interval_s == pytest.approx(math.sqrt(432000))
    # the overhead cap wins over max_interval_s; otherwise max_interval_s clamps
    assert YoungDaly(3600, initial_cost_s=60.0, max_interval_s=600).interval_s == pytest.approx(1200.0)
    assert YoungDaly(86400, initial_cost_s=4.0, max_interval_s=600).interval_s == 600.0
    # a near-free save does not mean a save every step
    assert YoungDaly(86400, initial_cost_s=0.001).interval_s == 60.0
    assert YoungDaly(86400, initial_cost_s=0.001, min_interval_s=0).interval_s == pytest.approx(math.sqrt(172.8))


def test_young_daly_measures_cost_when_none_given():
    p = YoungDaly(86400)
    assert p.cost_s is None and p.interval_s is None
    assert p.should_save(1, {}, 0.0) == "young-daly: first save, to measure its cost"
    assert p.should_save(2, {}, 1.0) is None  # waits for the measurement, does not fire again
    p.saved(1, 5.0, 2.0)
    p.saved(2, 6.0, 6.0)  # moving mean of measurements: C = 4
    assert p.cost_s == 4.0 and p.interval_s == pytest.approx(831.38, abs=0.01)
    p.saved(3, 7.0, float("nan"))
    p.saved(3, 7.0, -1.0)  # ignored
    assert p.cost_s == 4.0
    for c in [10.0] * 5:  # only the latest 5 count
        p.saved(4, 8.0, c)
    assert p.cost_s == 10.0
    assert p.should_save(5, {}, 8.0 + p.interval_s).startswith("young-daly: every 21m55s (C=10s")


def test_young_daly_clock_restarts_at_any_save():
    p = YoungDaly(86400, initial_cost_s=4.0)
    saves = drive(EveryNSteps(500) | p, times=[i * 2.0 for i in range(1, 2001)], cost_s=4.0)
    # every 500 steps = 1000 s > 831 s: Young-Daly fires 831 s after each step-triggered save
    assert saves[500] == "every 500 steps"
    young = [s for s, r in saves.items() if r.startswith("young-daly")]
    assert young[:2] == [417, 916]  # t=834 (>= 2 + 831.4, the first call) and t=1832 (>= 1000 + 831.4)


# --- state_dict -------------------------------------------------------------------------------------------------


def test_state_dict_round_trips_keep_memory():
    losses = decaying_then_flat(400)
    p = Phased(5, 20, window=20)
    drive(p, losses)
    q = roundtrip(p, Phased(5, 20, window=20))
    assert q.phase == p.phase == "late"
    tail = [1.0 + (i % 3) * 0.001 for i in range(100)] + [2.0] * 100  # flat, then a rise back to early
    saves = drive(q, tail, start=401)
    assert saves == drive(p, tail, start=401)
    assert 405 not in saves and 420 in saves and 505 in saves  # resumed sparse (a fresh one would save at 405)

    s = LossSpike(window=10, min_history=5, cooldown=5)
    drive(s, [1.0] * 10 + [5.0])
    t = roundtrip(s, LossSpike(window=10, min_history=5, cooldown=5))
    seq = [1.0, 5.0, 1.0, 1.0, 1.0, 5.0, float("nan")]  # steps 12-18; 11 fired, so 13 and 18 are cooling down
    assert drive(s, seq, start=12) == drive(t, seq, start=12) == {17: "loss spike: 5 > 2 x moving mean 1.8"}


def test_timers_store_elapsed_not_clock_values():
    p = EveryTSeconds(100)
    p.should_save(1, {}, 5000.0)
    p.should_save(2, {}, 5070.0)
    assert p.state_dict() == {"policy": "EveryTSeconds", "elapsed_s": 70.0}
    q = roundtrip(p, EveryTSeconds(100))  # another process: its monotonic clock starts anywhere
    assert q.should_save(3, {}, 12.0) is None
    assert q.should_save(4, {}, 41.9) is None
    assert q.should_save(5, {}, 42.0) == "every 1m40s"
    assert q.state_dict()["elapsed_s"] == 0.0  # fired at its latest call

    y = YoungDaly(86400)
    y.should_save(1, {}, 0.0)
    y.saved(1, 10.0, 4.0)
    y.should_save(2, {}, 510.0)
    state = y.state_dict()
    assert state == {"policy": "YoungDaly", "costs": [4.0], "elapsed_s": 500.0}
    z = roundtrip(y, YoungDaly(86400))
    assert z.cost_s == 4.0
    assert z.should_save(3, {}, 1.0) is None
    assert z.should_save(4, {}, 333.0) is not None  # 500 + 332 >= 831.4

    fresh = roundtrip(EveryTSeconds(5), EveryTSeconds(5))  # never called: nothing to restore
    assert fresh.should_save(1, {}, 0.0) is None and fresh.should_save(2, {}, 5.0)


def test_anyof_state_round_trip_and_mismatches():
    make = lambda: EveryNSteps(7) | LossSpike(window=5, min_history=2) | EveryTSeconds(30)
    p = make()
    drive(p, [1.0, 1.0, 1.0], times=[0, 10, 20])
    q = roundtrip(p, make())
    assert q.state_dict() == p.state_dict()
    with pytest.raises(ValueError, match="holds 3 policies, this AnyOf has 2"):
        (EveryNSteps(7) | EveryTSeconds(30)).load_state_dict(p.state_dict())
    with pytest.raises(ValueError, match="state is for policy 'LossSpike', not Phased"):
        Phased(5, 20).load_state_dict(LossSpike().state_dict())
    with pytest.raises(ValueError, match="takes the dict its state_dict"):
        EveryNSteps(3).load_state_dict([1, 2])


# --- parameters, repr, describe ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: EveryNSteps(0), r"EveryNSteps: n must be a positive int, got 0"),
    (lambda: EveryNSteps(2.5), r"positive int, got 2.5"),
    (lambda: EveryNSteps(True), r"positive int, got True"),
    (lambda: EveryTSeconds(0), r"EveryTSeconds: seconds must be a finite number > 0"),
    (lambda: EveryTSeconds(float("nan")), r"finite number > 0, got nan"),
    (lambda: EveryTSeconds(float("inf")), r"finite number > 0, got inf"),
    (lambda: Phased(200, 50), r"early_every \(200\) must be smaller than late_every \(50\)"),
    (lambda: Phased(0, 50), r"Phased: early_every must be a positive int"),
    (lambda: Phased(50, 200, switch_at_step=1000, window=10), r"switch_at_step switches by step alone, so window"),
    (lambda: Phased(50, 200, switch_at_step=0), r"Phased: switch_at_step must be a positive int"),
    (lambda: Phased(50, 200, flat_below=0), r"flat_below must be a fraction in \(0, 1\)"),
    (lambda: Phased(50, 200, flat_below=1.0), r"flat_below must be a fraction in \(0, 1\)"),
    (lambda: Phased(50, 200, rise_above=-0.1), r"rise_above must be a number > 0"),
    (lambda: Phased(50, 200, metric=""), r"metric must be the name of a metric"),
    (lambda: LossSpike(factor=1.0), r"LossSpike: factor must be > 1"),
    (lambda: LossSpike(factor=0.5), r"LossSpike: factor must be > 1"),
    (lambda: LossSpike(factor=-3), r"LossSpike: factor must be a finite number > 0"),
    (lambda: LossSpike(window=0), r"LossSpike: window must be a positive int"),
    (lambda: LossSpike(window=5, min_history=10), r"min_history \(10\) cannot exceed window \(5\)"),
    (lambda: LossSpike(cooldown=-1), r"LossSpike: cooldown must be an int >= 0"),
    (lambda: YoungDaly(0), r"YoungDaly: mtbf_s must be a finite number > 0"),
    (lambda: YoungDaly(3600, max_overhead=0), r"max_overhead must be a fraction in \(0, 1\]"),
    (lambda: YoungDaly(3600, max_overhead=1.5), r"max_overhead must be a fraction in \(0, 1\]"),
    (lambda: YoungDaly(3600, initial_cost_s=0), r"initial_cost_s must be a finite number > 0"),
    (lambda: YoungDaly(3600, min_interval_s=-1), r"min_interval_s must be a finite number >= 0"),
    (lambda: YoungDaly(3600, min_interval_s=600, max_interval_s=60), r"min_interval_s \(600\) must not exceed"),
])
def test_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_repr_and_describe():
    cases = {
        EveryNSteps(50): ("EveryNSteps(50)", "every 50 steps"),
        EveryTSeconds(1800): ("EveryTSeconds(1800)", "every 30m"),
        Phased(50, 200, switch_at_step=1000): ("Phased(50, 200, switch_at_step=1000)",
                                                "every 50 steps until step 1000, then every 200"),
        Phased(50, 200): ("Phased(50, 200, metric='loss', window=100, flat_below=0.01, rise_above=0.05)",
                          "every 50 steps while loss falls, every 200 once flat (moving mean improves < 1.00% "
                          "per 100 values; back to dense if it rises > 5.00%)"),
        LossSpike(): ("LossSpike(factor=2, window=50, metric='loss', min_history=10, cooldown=50)",
                      "when loss > 2x its mean over the last 50 values, or is non-finite (at most once per 50 steps)"),
        YoungDaly(86400, initial_cost_s=3): ("YoungDaly(86400, max_overhead=0.05, initial_cost_s=3)",
                                             "every sqrt(2 x save cost x MTBF 24h), overhead <= 5%, at least 1m"),
    }
    for policy, (rep, desc) in cases.items():
        assert repr(policy) == rep
        assert policy.describe() == desc

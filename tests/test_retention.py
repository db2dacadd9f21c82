"""Retention (luopan.retention): rules on hand-made histories, flag parsing, and property tests over random ones."""

import math
import random
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luopan.retention import (
    Checkpoint,
    KeepBest,
    KeepEvery,
    KeepEverySteps,
    KeepLast,
    KeepTagged,
    Plan,
    Retention,
    parse_duration,
    parse_keep_best,
    parse_keep_every_steps,
    parse_keep_last,
    plan,
    rules_from_flags,
)

T0 = datetime(2024, 5, 1, tzinfo=timezone.utc)
HOUR = 3600.0
DAY = 86400.0


def ck(step, hours=None, loss=None, *, pinned=False, tags=(), **metrics):
    """A checkpoint at T0 + hours (default: step hours), with loss when given."""
    if loss is not None:
        metrics["loss"] = loss
    created = T0 + timedelta(hours=step if hours is None else hours)
    return Checkpoint(step, created, metrics, pinned, tuple(tags))


def survivors(checkpoints, p):
    return [c for c in checkpoints if c.step in p.keep]


# --- each rule on hand-made histories ----------------------------------------------------------------------------


def test_keep_last():
    cks = [ck(s) for s in (10, 20, 30, 40, 50)]
    p = plan(cks, KeepLast(2))
    assert p.keep == {40: ["latest #2"], 50: ["newest", "latest #1"]}
    assert p.remove == [10, 20, 30]
    assert plan(cks, KeepLast(9)).remove == []


def test_keep_last_is_by_step_not_by_time():
    cks = [ck(1, hours=5), ck(2, hours=1), ck(3, hours=0)]  # clock went backwards: steps still decide
    p = plan(cks, KeepLast(1))
    assert p.keep == {3: ["newest", "latest #1"]} and p.remove == [1, 2]


def test_keep_best_min_and_max():
    cks = [ck(1, loss=0.9, acc=0.1), ck(2, loss=0.3, acc=0.7), ck(3, loss=0.5, acc=0.9), ck(4, loss=0.8, acc=0.2)]
    p = plan(cks, KeepBest(2, "loss"))
    assert p.keep == {2: ["best loss #1"], 3: ["best loss #2"], 4: ["newest"]}
    assert p.remove == [1]
    p = plan(cks, KeepBest(1, "acc", mode="max"))
    assert p.keep == {3: ["best acc #1"], 4: ["newest"]}


def test_keep_best_ignores_missing_nan_inf_and_non_numbers():
    cks = [ck(1, loss=float("nan")), ck(2), ck(3, loss=float("-inf")), ck(4, loss="0.1"), ck(5, loss=True),
           ck(6, loss=0.7), ck(7, loss=None), ck(8, loss=0.9), ck(9, loss=float("inf"))]
    p = plan(cks, KeepBest(5, "loss"))
    assert p.keep == {6: ["best loss #1"], 8: ["best loss #2"], 9: ["newest"]}
    assert p.remove == [1, 2, 3, 4, 5, 7]


def test_keep_best_ties_rank_the_newer_step_first():
    cks = [ck(1, loss=0.5), ck(2, loss=0.5), ck(3, loss=0.5), ck(4, loss=0.9)]
    assert plan(cks, KeepBest(2, "loss")).keep == {2: ["best loss #2"], 3: ["best loss #1"], 4: ["newest"]}
    assert plan(cks, KeepBest(1, "loss", "max")).keep == {4: ["newest", "best loss #1"]}


def test_keep_best_ints_and_numpy_scalars_count():
    np = pytest.importorskip("numpy")
    cks = [ck(1, loss=2), ck(2, loss=np.float32(1.5)), ck(3, loss=np.float64("nan")), ck(4, loss=3)]
    assert plan(cks, KeepBest(1, "loss")).keep == {2: ["best loss #1"], 4: ["newest"]}


def test_keep_every_keeps_the_newest_of_each_utc_day():
    # six-hourly saves over three days from 2024-05-01T00:00Z, plus one at 23:59:59.999999 on day 2
    cks = [ck(i, hours=6 * i) for i in range(12)]
    late = Checkpoint(100, T0 + timedelta(days=2) - timedelta(microseconds=1), {})
    p = plan(cks + [late], KeepEvery(DAY))
    # day 1: steps 0-3 (hours 0..18) -> 3; day 2: 4-7 and step 100 (latest time) -> 100; day 3: 8-11 -> 11
    assert {s for s, r in p.keep.items() if "every 24h" in r} == {3, 100, 11}
    assert p.keep[100] == ["newest", "every 24h"]  # newest = highest step, even though not latest in time
    assert p.remove == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]


def test_keep_every_bucket_edges_are_exact():
    rule = KeepEvery(HOUR)
    assert rule.bucket(T0) == rule.bucket(T0 + timedelta(minutes=59, seconds=59, microseconds=999999))
    assert rule.bucket(T0 + timedelta(hours=1)) == rule.bucket(T0) + 1
    before_epoch = datetime(1969, 12, 31, 23, 30, tzinfo=timezone.utc)
    assert rule.bucket(before_epoch) == -1
    # another timezone names the same instant, hence the same bucket
    tz = timezone(timedelta(hours=8))
    assert rule.bucket(T0.astimezone(tz)) == rule.bucket(T0)


def test_keep_every_equal_times_keep_the_higher_step():
    cks = [ck(1, hours=0), ck(2, hours=0), ck(3, hours=30)]
    assert plan(cks, KeepEvery(DAY)).keep == {2: ["every 24h"], 3: ["newest", "every 24h"]}


def test_keep_every_with_an_anchor():
    anchor = T0 + timedelta(hours=12)  # days from noon to noon
    cks = [ck(i, hours=6 * i) for i in range(6)]  # hours 0..30
    p = plan(cks, KeepEvery(DAY, anchor=anchor))
    # buckets: [-12h, 12h) holds hours 0, 6 -> step 1; [12h, 36h) holds 12..30 -> step 5
    assert p.keep == {1: ["every 24h"], 5: ["newest", "every 24h"]}


def test_keep_every_steps():
    cks = [ck(s) for s in range(0, 30001, 2500)]  # 0, 2500, ..., 30000
    p = plan(cks, KeepEverySteps(10000))
    assert {s for s, r in p.keep.items() if "every 10000 steps" in r} == {7500, 17500, 27500, 30000}
    assert p.keep[30000] == ["newest", "every 10000 steps"]


def test_keep_tagged_and_pinned():
    cks = [ck(1, tags=("release",)), ck(2, pinned=True), ck(3, pinned=True, tags=("release",)), ck(4), ck(5)]
    p = plan(cks, KeepTagged("release"))
    assert p.keep == {1: ["tag release"], 2: ["pinned"], 3: ["pinned", "tag release"], 5: ["newest"]}
    assert p.remove == [4]


def test_reasons_collect_every_rule_in_order():
    cks = [ck(1, loss=0.1), ck(2, loss=0.5, pinned=True), ck(3, loss=0.9)]
    p = plan(cks, KeepLast(1) | KeepBest(1, "loss") | KeepEverySteps(10) | KeepEvery(DAY))
    assert p.keep == {
        1: ["best loss #1"],
        2: ["pinned"],
        3: ["newest", "latest #1", "every 10 steps", "every 24h"],
    }
    assert p.remove == []


def test_combination_forms_are_the_same():
    cks = [ck(s, loss=random.Random(s).random()) for s in range(1, 40)]
    a = plan(cks, KeepLast(3) | KeepBest(2, "loss"))
    b = plan(cks, Retention(KeepLast(3), KeepBest(2, "loss")))
    c = plan(cks, [KeepLast(3), KeepBest(2, "loss")])
    d = plan(cks, Retention(KeepLast(3)) | Retention(KeepBest(2, "loss")))
    assert a == b == c == d
    assert len((KeepLast(1) | KeepLast(2) | KeepLast(3)).rules) == 3  # flattened


def test_no_rule_is_refused():
    cks = [ck(1), ck(2)]
    for rules in ([], (), Retention(), rules_from_flags()):
        with pytest.raises(ValueError, match="no keep rule given: this would remove every checkpoint but the "
                                             "newest; pass --keep-last N or similar"):
            plan(cks, rules)
    with pytest.raises(ValueError, match="no keep rule"):
        plan([], [])


def test_empty_history_and_single_checkpoint():
    assert plan([], KeepLast(1)) == Plan({}, [], (), "the last 1")
    p = plan([ck(7)], KeepBest(1, "loss"))
    assert p.keep == {7: ["newest"]} and p.remove == []


def test_bad_plan_input():
    with pytest.raises(ValueError, match="step 2 is listed twice"):
        plan([ck(2), ck(1), ck(2, hours=9)], KeepLast(1))
    with pytest.raises(TypeError, match="Checkpoint.from_info"):
        plan([SimpleNamespace(step=1)], KeepLast(1))
    with pytest.raises(TypeError, match="retention rules"):
        plan([ck(1)], [KeepLast(1), 5])
    with pytest.raises(TypeError, match="retention rule"):
        plan([ck(1)], "keep-last 5")
    with pytest.raises(ValueError, match="timezone-aware"):
        Checkpoint(1, datetime(2024, 1, 1), {})
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        Checkpoint(-1, T0, {})
    with pytest.raises(ValueError, match="tags must be a tuple of str"):
        Checkpoint(1, T0, {}, tags="release")


def test_bad_rule_arguments():
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="positive int"):
            KeepLast(bad)
        with pytest.raises(ValueError, match="positive int"):
            KeepEverySteps(bad)
        with pytest.raises(ValueError, match="positive int"):
            KeepBest(bad, "loss")
    with pytest.raises(ValueError, match="non-empty str"):
        KeepBest(1, "")
    with pytest.raises(ValueError, match="'min' .* or 'max'"):
        KeepBest(1, "loss", "lowest")
    for bad in (0, -5, float("nan"), float("inf"), 1e-7, True, "1h"):
        with pytest.raises(ValueError, match="KeepEvery"):
            KeepEvery(bad)
    with pytest.raises(ValueError, match="too long"):
        KeepEvery(1e300)
    with pytest.raises(ValueError, match="non-empty str"):
        KeepTagged("")
    assert KeepEvery(timedelta(hours=2)).seconds == 7200


def test_from_info_reads_a_checkpoint_listing():
    info = SimpleNamespace(run="r", step=300, created="2024-05-01T12:00:00.123456+00:00",
                           metrics={"loss": 0.5, "note": "x"})
    c = Checkpoint.from_info(info, pinned=True, tags=["best"])
    assert c == Checkpoint(300, datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=timezone.utc),
                           {"loss": 0.5, "note": "x"}, True, ("best",))
    assert Checkpoint.from_info(SimpleNamespace(step=1, created="2024-05-01T12:00:00Z", metrics={})).created == \
        datetime(2024, 5, 1, 12, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="no timezone"):
        Checkpoint.from_info(SimpleNamespace(step=1, created="2024-05-01T12:00:00", metrics={}))
    with pytest.raises(ValueError, match="not ISO-8601"):
        Checkpoint.from_info(SimpleNamespace(step=1, created="yesterday", metrics={}))


def test_from_info_with_a_real_repository(repo):
    for step, loss in ((1, 0.9), (2, 0.2), (3, 0.5)):
        repo.save("r", step=step, state={"x": step}, metrics={"loss": loss})
    cks = [Checkpoint.from_info(i, pinned=i.step == 1) for i in repo.checkpoints("r")]
    p = plan(cks, KeepBest(1, "loss"))
    assert p.keep == {1: ["pinned"], 2: ["best loss #1"], 3: ["newest"]} and p.remove == []
    assert plan(cks, KeepLast(1)).remove == [2]


def test_describe():
    cks = [ck(1, loss=0.1), ck(2, loss=0.5, pinned=True), ck(3, loss=0.9), ck(10, loss=0.95)]
    lines = plan(cks, KeepLast(1) | KeepBest(1, "loss")).describe()
    assert lines == [
        "rules: always the newest and pinned; the last 1; the best 1 by loss (lowest)",
        "keep    step  1  2024-05-01T01:00:00+00:00  (best loss #1)",
        "keep    step  2  2024-05-01T02:00:00+00:00  (pinned)",
        "remove  step  3  2024-05-01T03:00:00+00:00",
        "keep    step 10  2024-05-01T10:00:00+00:00  (newest, latest #1)",
        "keeping 3 of 4 checkpoints, removing 1",
    ]
    assert KeepEvery(90 * 60).describe() == "the newest in each 1h30m"
    assert KeepEvery(7 * DAY).describe() == "the newest in each 7d"
    assert KeepEvery(0.5).describe() == "the newest in each 0.5s"
    assert repr(KeepLast(5) | KeepBest(3, "loss") | KeepEvery(DAY) | KeepEverySteps(10)) == \
        "KeepLast(5) | KeepBest(3, 'loss', 'min') | KeepEvery(86400) | KeepEverySteps(10)"


# --- CLI flag parsing --------------------------------------------------------------------------------------------


def test_parse_duration():
    assert parse_duration("24h") == 86400
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("90m") == 5400
    assert parse_duration("3600s") == 3600
    assert parse_duration("2w") == 14 * 86400
    assert parse_duration("1h30m") == 5400
    assert parse_duration(" 1.5H ") == 5400
    assert parse_duration("0.5s") == 0.5
    # one grammar for every duration (luopan.units): spaces and spelled-out units are accepted too
    assert parse_duration("24 h") == parse_duration("24hours") == 86400


@pytest.mark.parametrize("bad", ["", "h", "24", "24x", "-1h", "1h-30m", "0h", "0s0m", "1e3s", "h24", None, 24])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError, match="duration") as e:
        parse_duration(bad)
    if bad not in ("0h", "0s0m"):
        assert "e.g. 24h, 7d, 90m, 3600s" in str(e.value)
    if bad == "24":
        assert "unit is required" in str(e.value)


def test_parse_keep_best():
    for text, want in [("3:loss:min", (3, "loss", "min")), ("2:accuracy:max", (2, "accuracy", "max")),
                       ("1:loss", (1, "loss", "min")), ("3:eval:loss:max", (3, "eval:loss", "max")),
                       ("4:eval/loss", (4, "eval/loss", "min")), ("2:val:loss", (2, "val:loss", "min"))]:
        r = parse_keep_best(text)
        assert (r.n, r.metric, r.mode) == want


@pytest.mark.parametrize("bad,match", [("3", "N:METRIC"), ("loss:3:min", "N:METRIC"), ("0:loss:min", "at least 1"),
                                       ("3::min", "no metric"), ("3:", "no metric"), (":loss", "N:METRIC"),
                                       ("3:loss:MAX", "'min' or 'max'"), ("3:loss:lower", "'min' or 'max'"),
                                       ("-3:loss", "N:METRIC"), ("3.5:loss", "N:METRIC"), (None, "N:METRIC")])
def test_parse_keep_best_rejects(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_keep_best(bad)
    assert "--keep-best" in str(e.value)


def test_parse_counts():
    assert parse_keep_last("5").n == 5 and parse_keep_last(5).n == 5
    assert parse_keep_every_steps("10_000").n == 10000 and parse_keep_every_steps(" 10000 ").n == 10000
    for bad in ("0", "-1", "five", "1.5", "", True, 0, None):
        with pytest.raises(ValueError, match="--keep-last takes N, a positive integer"):
            parse_keep_last(bad)
        with pytest.raises(ValueError, match="--keep-every-steps takes N"):
            parse_keep_every_steps(bad)


def test_rules_from_flags():
    r = rules_from_flags(keep_last="5", keep_best=["3:loss:min", "1:acc:max"], keep_every=["24h"],
                         keep_every_steps=["10000"], keep_tag=["release"])
    assert repr(r) == ("KeepLast(5) | KeepBest(3, 'loss', 'min') | KeepBest(1, 'acc', 'max') | KeepEvery(86400) | "
                       "KeepEverySteps(10000) | KeepTagged('release')")
    with pytest.raises(ValueError, match="duration '24'"):
        rules_from_flags(keep_every=["24"])


# --- properties over random histories ----------------------------------------------------------------------------


_VALUE = st.one_of(st.sampled_from([0.0, 0.5, 1]), st.floats(-10, 10), st.just(float("nan")),  # ties are common
                   st.sampled_from([float("inf"), float("-inf")]), st.integers(-3, 3), st.just(None), st.just("x"))
_SAVE = st.tuples(
    st.integers(1, 500),  # step gap
    st.integers(0, 3 * 86400 * 10**6),  # time gap in microseconds (0: equal times)
    st.dictionaries(st.sampled_from(["loss", "acc"]), _VALUE, max_size=2),
    st.sets(st.sampled_from(["a", "b"]), max_size=2),
    st.integers(0, 3),  # pinned when 0
    st.integers(-12, 12),  # timezone offset in hours
)


@st.composite
def histories(draw):
    """Random histories: increasing steps, times increasing or not (ties, a clock that disagrees), metrics with
    NaN, ±inf, missing and non-numbers, tags, pins, mixed timezones."""
    n = draw(st.integers(0, 25))
    saves = draw(st.lists(_SAVE, min_size=n, max_size=n))
    step, t = draw(st.integers(0, 100)), T0 - timedelta(days=draw(st.integers(-3, 3)))
    out = []
    for step_gap, us, metrics, tags, pin, tz in saves:
        step, t = step + step_gap, t + timedelta(microseconds=us)
        out.append(Checkpoint(step, t.astimezone(timezone(timedelta(hours=tz))), metrics, pin == 0, tuple(tags)))
    if draw(st.booleans()):  # sometimes the clock disagrees with the steps
        times = draw(st.permutations([c.created for c in out]))
        out = [Checkpoint(c.step, tm, c.metrics, c.pinned, c.tags) for c, tm in zip(out, times)]
    return out


rule_strategy = st.one_of(
    st.builds(KeepLast, st.integers(1, 8)),
    st.builds(KeepBest, st.integers(1, 5), st.sampled_from(["loss", "acc"]), st.sampled_from(["min", "max"])),
    st.builds(KeepEvery, st.sampled_from([1.0, 90.0, HOUR, 6 * HOUR, DAY, 7 * DAY, 12345.678])),
    st.builds(KeepEverySteps, st.integers(1, 3000)),
    st.builds(KeepTagged, st.sampled_from(["a", "b"])),
)
rule_sets = st.lists(rule_strategy, min_size=1, max_size=5)


def usable(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def reference_keep(cks, rule):
    """What a rule must keep, written independently of the module: plain loops over the history."""
    if isinstance(rule, KeepLast):
        return set(sorted(c.step for c in cks)[-rule.n:])
    if isinstance(rule, KeepBest):
        eligible = [c for c in cks if usable(c.metrics.get(rule.metric))]
        better = (lambda a, b: a < b) if rule.mode == "min" else (lambda a, b: a > b)
        chosen = set()
        for c in eligible:  # c is among the n best iff fewer than n others rank before it
            v = c.metrics[rule.metric]
            ahead = sum(1 for d in eligible if d is not c and (better(d.metrics[rule.metric], v) or
                                                              (d.metrics[rule.metric] == v and d.step > c.step)))
            if ahead < rule.n:
                chosen.add(c.step)
        return chosen
    if isinstance(rule, KeepEvery):
        period_us = round(rule.seconds * 10**6)
        buckets = {}
        for c in cks:
            us = (c.created - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
            buckets.setdefault(us // period_us, []).append(c)
        return {max(group, key=lambda c: (c.created, c.step)).step for group in buckets.values()}
    if isinstance(rule, KeepEverySteps):
        buckets = {}
        for c in cks:
            buckets.setdefault(c.step // rule.n, []).append(c.step)
        return {max(group) for group in buckets.values()}
    if isinstance(rule, KeepTagged):
        return {c.step for c in cks if rule.tag in c.tags}
    raise AssertionError(rule)


@settings(max_examples=200, deadline=None)
@given(histories(), rule_sets)
def test_plan_matches_reference_and_protects(cks, rules):
    p = plan(cks, rules)
    steps = {c.step for c in cks}
    assert set(p.keep).isdisjoint(p.remove) and set(p.keep) | set(p.remove) == steps
    assert p.remove == sorted(p.remove) and list(p.keep) == sorted(p.keep)
    assert all(p.keep.values())
    protected = {c.step for c in cks if c.pinned} | ({max(steps)} if steps else set())
    for c in cks:
        if c.pinned:
            assert "pinned" in p.keep[c.step]
    if steps:
        assert p.keep[max(steps)][0] == "newest"
    expected = set(protected)
    for r in rules:
        chosen = reference_keep(cks, r)
        assert chosen <= set(p.keep), (r, chosen - set(p.keep))  # each rule's category survives
        expected |= chosen
    assert set(p.keep) == expected  # and nothing else: the union, no more
    # each rule alone chooses exactly its category, and ranks it 1..k
    ordered = sorted(cks, key=lambda c: c.step)
    for r in rules:
        chosen = r.keep(ordered)
        assert set(chosen) == reference_keep(cks, r)
        if isinstance(r, (KeepLast, KeepBest)):
            assert sorted(int(reason.rsplit("#", 1)[1]) for reason in chosen.values()) == \
                list(range(1, len(chosen) + 1))


@settings(max_examples=200, deadline=None)
@given(histories(), rule_sets)
def test_planning_again_on_the_survivors_changes_nothing(cks, rules):
    p = plan(cks, rules)
    again = plan(survivors(cks, p), rules)
    assert again.remove == []
    assert again.keep == p.keep  # same checkpoints, same reasons


@settings(max_examples=200, deadline=None)
@given(histories(), rule_sets, st.randoms(use_true_random=False))
def test_plan_is_deterministic_and_order_free(cks, rules, rnd):
    p = plan(cks, rules)
    shuffled = list(cks)
    rnd.shuffle(shuffled)
    q = plan(shuffled, rules)
    assert q == p and q.describe() == p.describe()


@settings(max_examples=200, deadline=None)
@given(histories(), rule_sets)
def test_dry_run_lines_name_exactly_what_is_removed(cks, rules):
    p = plan(cks, rules)
    lines = p.describe()
    removed = [int(line.split()[2]) for line in lines if line.startswith("remove ")]
    kept = [int(line.split()[2]) for line in lines if line.startswith("keep ")]
    assert removed == p.remove and sorted(kept) == list(p.keep)
    assert lines[-1] == f"keeping {len(p.keep)} of {len(cks)} checkpoint{'s' if len(cks) != 1 else ''}, " \
                        f"removing {len(p.remove)}"


@settings(max_examples=200, deadline=None)
@given(histories(), rule_sets, rule_strategy)
def test_more_rules_never_remove_more(cks, rules, extra):
    assert set(plan(cks, rules + [extra]).remove) <= set(plan(cks, rules).remove)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4 * 3600), min_size=10, max_size=80), st.sampled_from([HOUR, 6 * HOUR, DAY]))
def test_pruning_after_every_save_keeps_one_per_period(gaps_s, period):
    """A run pruned after each save still holds one checkpoint for every time bucket that ever held one (buckets
    counted back from the newest would move with each save and erode this)."""
    rules = KeepLast(2) | KeepEvery(period)
    held, seen_buckets, t = [], set(), T0
    for step, gap in enumerate(gaps_s, 1):
        t += timedelta(seconds=gap)
        held.append(Checkpoint(step, t, {}))
        seen_buckets.add(KeepEvery(period).bucket(t))
        p = plan(held, rules)
        held = survivors(held, p)
        assert {KeepEvery(period).bucket(c.created) for c in held} == seen_buckets
    assert held[-1].step == len(gaps_s)

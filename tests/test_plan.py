"""`luopan plan`: the reference article's checkpoint cost figures, Young/Daly, parsing, the probe, LoRA columns."""

import json
import math

import pytest
from typer.testing import CliRunner

from luopan import plan
from luopan.cli.app import exit_code_for
from luopan.cli.main import app

runner = CliRunner()

ARTICLE = ["plan", "--params", "7B", "--params", "70B", "--bandwidth", "500MB/s", "--interval", "2h",
           "--interval", "4h"]


def cli(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def plan_json(*args):
    r = cli(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def within(value, target, tolerance=0.15):
    return abs(value - target) <= tolerance * target


def test_article_configuration_reproduces_its_figures():
    d = plan_json(*ARTICLE)
    assert d["accounting"]["bytes_per_param"] == {"weights": 2, "master_weights": 0, "optimizer": 8, "total": 10}
    m7, m70 = d["models"]
    assert (m7["label"], m70["label"]) == ("7B", "70B")
    # 7B: the article's "~80 GB, ~160 s, 160/7200 ≈ 2.2%"
    assert within(m7["full"]["bytes_per_save"], 80e9)
    assert within(m7["full"]["seconds_per_save"], 160)
    assert m7["full"]["intervals"][0]["interval_s"] == 7200
    assert within(m7["full"]["intervals"][0]["save_fraction"], 0.022)
    # 70B: "~700 GB, 1,400 s", and "close to 10%" saving every 4 h
    assert within(m70["full"]["bytes_per_save"], 700e9)
    assert within(m70["full"]["seconds_per_save"], 1400)
    assert within(m70["full"]["intervals"][1]["save_fraction"], 0.10)
    # the article's itemised components, exactly: 14 GB weights + 56 GB optimizer state for 7B
    assert m7["full"]["bytes_per_save"] == 14e9 + 56e9


def test_article_table_output():
    r = cli(*ARTICLE)
    assert r.exit_code == 0, r.output
    for text in ("decimal", "10 B/param", "500 MB/s", "70.0 GB", "140 s", "1.94%", "700.0 GB", "1,400 s",
                 "9.72%", "give --mtbf"):
        assert text in r.output, text


def test_master_weights_and_optimizers_change_the_accounting():
    def per_param(*flags):
        return plan_json("plan", "--params", "1B", "--bandwidth", "1GB/s", *flags)["accounting"]["bytes_per_param"]

    assert per_param("--master-weights", "fp32")["total"] == 14
    assert per_param("--optimizer", "sgd-momentum")["total"] == 6
    assert per_param("--optimizer", "sgd")["total"] == per_param("--optimizer", "none")["total"] == 2
    assert per_param("--weights", "fp32", "--optimizer", "none")["total"] == 4
    r = cli("plan", "--params", "1B", "--bandwidth", "1GB/s", "--weights", "fp32", "--master-weights", "fp32")
    assert r.exit_code == 2 and "counts the same tensor twice" in r.output


def test_young_daly_hand_computed():
    # C = 100 GB / 1 GB/s = 100 s, M = 5 h = 18,000 s: T* = sqrt(2·100·18000) = 1,897.4 s,
    # overhead C/T* + T*/(2M) = 0.052705 + 0.052705 = sqrt(2C/M) = 0.105409
    assert plan.young_daly_interval(100, 18000) == pytest.approx(1897.366596)
    assert plan.expected_overhead(100, 1897.366596, 18000) == pytest.approx(math.sqrt(2 * 100 / 18000))
    d = plan_json("plan", "--params", "10B", "--optimizer", "none", "--weights", "fp32", "--master-weights", "none",
                  "--bandwidth", "1GB/s", "--interval", "1h", "--mtbf", "5h")
    full = d["models"][0]["full"]
    assert full["seconds_per_save"] == pytest.approx(40)  # 10B × 4 B / 1 GB/s
    assert full["young_daly"]["interval_s"] == pytest.approx(math.sqrt(2 * 40 * 18000))
    assert full["young_daly"]["expected_fraction"] == pytest.approx(math.sqrt(2 * 40 / 18000))
    assert full["young_daly"]["save_fraction"] == pytest.approx(40 / math.sqrt(2 * 40 * 18000))
    # the 1 h interval: C/T = 40/3600, plus T/(2M) = 3600/36000 of lost work; worse than at T*
    assert full["intervals"][0]["save_fraction"] == pytest.approx(40 / 3600)
    assert full["intervals"][0]["expected_fraction"] == pytest.approx(40 / 3600 + 0.1)
    assert full["intervals"][0]["expected_fraction"] > full["young_daly"]["expected_fraction"]


def test_lora_fraction_shrinks_bytes_per_save_proportionally():
    d = plan_json(*ARTICLE, "--lora-fraction", "0.01", "--mtbf", "24h")
    for m in d["models"]:
        full, inc = m["full"], m["incremental"]
        assert inc["bytes_per_save"] == pytest.approx(0.01 * full["bytes_per_save"])
        assert inc["seconds_per_save"] == pytest.approx(0.01 * full["seconds_per_save"])
        assert inc["trainable_params"] == pytest.approx(0.01 * m["params"])
        assert inc["base_bytes_once"] == pytest.approx(2 * m["params"])  # bf16 base weights, written once
        assert inc["young_daly"]["interval_s"] < full["young_daly"]["interval_s"]
    assert plan_json(*ARTICLE, "--lora-fraction", "10%")["models"][0]["incremental"]["bytes_per_save"] \
        == pytest.approx(7e9)
    assert plan_json(*ARTICLE)["models"][0]["incremental"] is None
    r = cli(*ARTICLE, "--lora-fraction", "0.01")
    assert "incremental (LoRA 1%)" in r.output and "written once (frozen base)" in r.output and "14.0 GB" in r.output


@pytest.mark.parametrize("text, value", [("7B", 7e9), ("70b", 70e9), ("1.5e9", 1.5e9), ("350M", 350e6),
                                         ("1.2T", 1.2e12), ("7_000_000_000", 7e9), ("125k", 125e3)])
def test_parse_count(text, value):
    assert plan.parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text, value", [("500MB/s", 500e6), ("1GB/s", 1e9), ("1.5 GiB/s", 1.5 * 2**30),
                                         ("200mib/s", 200 * 2**20)])
def test_parse_rate(text, value):
    assert plan.parse_rate(text) == pytest.approx(value)


@pytest.mark.parametrize("text, value", [("2h", 7200), ("30m", 1800), ("90s", 90), ("1.5d", 129600),
                                         ("1h30m", 5400), ("45 min", 2700), ("2 weeks", 1209600)])
def test_parse_duration(text, value):
    assert plan.parse_duration(text) == pytest.approx(value)


def test_parse_bytes_and_fraction():
    assert plan.parse_bytes("256MiB") == 256 * 2**20
    assert plan.parse_bytes("1GB") == 10**9
    assert plan.parse_bytes("4096") == 4096
    assert plan.parse_fraction("0.01") == 0.01
    assert plan.parse_fraction("1%") == pytest.approx(0.01)


@pytest.mark.parametrize("parse, text, message", [
    (plan.parse_count, "7X", "unknown suffix"),
    (plan.parse_count, "seven", "not a parameter count"),
    (plan.parse_count, "0B", "at least one parameter"),
    (plan.parse_rate, "500MB", "not a bandwidth"),
    (plan.parse_rate, "500furlongs/s", "unknown unit"),
    (plan.parse_rate, "0GB/s", "must be positive"),
    (plan.parse_duration, "2", "a unit is missing"),
    (plan.parse_duration, "2 fortnights", "unknown unit"),
    (plan.parse_duration, "soon", "not a duration"),
    (plan.parse_duration, "0h", "must be positive"),
    (plan.parse_bytes, "12 parsecs", "unknown unit"),
    (plan.parse_fraction, "2", "at most 1"),
    (plan.parse_fraction, "0", "above 0"),
    (plan.parse_fraction, "a lot", "not a fraction"),
])
def test_parse_errors_are_typed(parse, text, message):
    with pytest.raises(plan.PlanInputError, match=message) as info:
        parse(text)
    assert isinstance(info.value, ValueError) and exit_code_for(info.value) == 2


@pytest.mark.parametrize("args, message", [
    (["--params", "7X", "--bandwidth", "1GB/s"], "unknown suffix"),
    (["--params", "7B", "--bandwidth", "500MB"], "not a bandwidth"),
    (["--params", "7B", "--bandwidth", "1GB/s", "--interval", "2"], "unit is missing"),
    (["--params", "7B", "--bandwidth", "1GB/s", "--mtbf", "often"], "not a duration"),
    (["--params", "7B", "--bandwidth", "1GB/s", "--lora-fraction", "1.5"], "at most 1"),
    (["--params", "7B", "--bandwidth", "1GB/s", "--optimizer", "lion"], "lion"),
    (["--params", "7B"], "--probe DIR"),
    (["--params", "7B", "--bandwidth", "1GB/s", "--probe", "."], "not both"),
    (["--bandwidth", "1GB/s"], "--params"),
])
def test_cli_usage_errors_exit_2(args, message):
    r = cli("plan", *args)
    assert r.exit_code == 2
    assert message in " ".join(r.output.split()).replace("│ ", "").replace(" │", "")


def test_probe_measures_and_leaves_no_file(tmp_path):
    d = plan_json("plan", "--params", "7B", "--probe", str(tmp_path), "--probe-size", "2MiB")
    assert d["probe"]["bytes"] == 2 * 2**20 and d["probe"]["seconds"] > 0
    assert d["bandwidth_bytes_per_s"] == pytest.approx(d["probe"]["bytes"] / d["probe"]["seconds"])
    assert d["models"][0]["full"]["seconds_per_save"] == pytest.approx(70e9 / d["bandwidth_bytes_per_s"])
    assert list(tmp_path.iterdir()) == []
    r = cli("plan", "--params", "7B", "--probe", str(tmp_path), "--probe-size", "1MiB")
    assert r.exit_code == 0 and "measured" in r.output and "1.0 MiB" in r.output
    assert list(tmp_path.iterdir()) == []


def test_probe_removes_its_file_on_interrupt(tmp_path):
    seen = []

    def interrupt(n):
        seen.append(list(tmp_path.iterdir()))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plan.probe_bandwidth(tmp_path, 16 * 2**20, progress=interrupt)
    assert [p.name.startswith(".luopan-probe-") for p in seen[0]] == [True]  # it was there mid-write
    assert list(tmp_path.iterdir()) == []


def test_probe_errors(tmp_path):
    r = cli("plan", "--params", "7B", "--probe", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "not a directory" in r.output
    r = cli("plan", "--params", "7B", "--probe", str(tmp_path), "--probe-size", "0")
    assert r.exit_code == 2 and "at least one byte" in r.output

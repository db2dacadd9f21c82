"""luopan.units: the one grammar for durations and byte sizes, and the formats that read back."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luopan import plan, retention, units
from luopan.errors import PlanInputError, UsageError
from luopan.units import format_bytes, format_duration, parse_bytes, parse_duration

# --- durations ---------------------------------------------------------------------------------------------------

DURATIONS = [
    ("24h", 86400), ("24 h", 86400), (" 1.5H ", 5400), ("7d", 7 * 86400), ("2w", 14 * 86400), ("90m", 5400),
    ("45 min", 2700), ("3600s", 3600), ("0.5s", 0.5), (".5h", 1800), ("1h30m", 5400), ("1h 30m", 5400),
    ("1 hour 30 minutes", 5400), ("2 weeks", 14 * 86400), ("1 day", 86400), ("3 days", 3 * 86400),
    ("10 secs", 10), ("1 second", 1), ("2 mins", 120), ("1 minute", 60), ("2 hrs", 7200), ("1hr", 3600),
    ("1 week", 604800), ("1d12h", 129600), ("1.5d", 129600), ("2h30m15s", 9015), ("10sec", 10),
]


@pytest.mark.parametrize("text, seconds", DURATIONS)
def test_durations_accepted(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, message", [
    ("", "not a duration"),
    ("h", "not a duration"),
    ("soon", "not a duration"),
    ("h24", "not a duration"),
    ("-1h", "not a duration"),
    ("+1h", "not a duration"),
    ("1h-30m", "not a duration"),
    ("1.5.3h", "not a duration"),
    ("1_000s", "not a duration"),
    ("24", "a unit is missing"),
    ("1h30", "a unit is missing"),
    ("24x", "unknown unit 'x'"),
    ("2 fortnights", "unknown unit"),
    ("24 months", "unknown unit"),
    ("1e3s", "exponents are not accepted"),
    ("1.5e+2h", "exponents are not accepted"),
    ("0h", "must be positive"),
    ("0s0m", "must be positive"),
    ("9" * 400 + "h", "too long"),
    (None, "must be a str"),
    (24, "must be a str"),
])
def test_durations_rejected(text, message):
    with pytest.raises(UsageError, match=message) as e:
        parse_duration(text)
    assert isinstance(e.value, ValueError)
    if message not in ("must be positive", "too long"):
        assert "e.g. 24h, 7d, 90m, 3600s or 1h30m" in str(e.value)


def test_zero_only_when_allowed():
    assert parse_duration("0s", allow_zero=True) == 0
    assert parse_duration("0h 0m", allow_zero=True) == 0
    with pytest.raises(UsageError, match="a unit is missing"):
        parse_duration("0", allow_zero=True)  # a bare number is never a duration


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.25, "0.25s"), (4, "4s"), (10, "10s"), (12.5, "12.5s"), (59.96, "1m"), (60, "1m"), (90, "1m30s"),
    (831.4, "13m51s"), (1000, "16m40s"), (1800, "30m"), (3601, "1h1s"), (5400, "1h30m"), (86400, "24h"),
    (129600, "36h"), (2 * 86400, "2d"), (216000, "2d12h"), (7 * 86400, "7d"), (1e-7, "0.0000001s"), (-90, "-1m30s"),
    (math.inf, "inf"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**9))
def test_whole_seconds_round_trip(seconds):
    assert parse_duration(format_duration(seconds)) == seconds


@settings(max_examples=300, deadline=None)
@given(st.floats(1e-6, 1e8, allow_nan=False, allow_infinity=False))
def test_any_positive_duration_reads_back_close(seconds):
    back = parse_duration(format_duration(seconds))
    assert abs(back - seconds) <= (0.5 if seconds >= 59 else 5e-3 * seconds)  # 3 digits below a minute, then whole s


# --- sizes -------------------------------------------------------------------------------------------------------

SIZES = [
    ("4096", 4096), ("1B", 1), ("1 b", 1), ("1KB", 1000), ("1kb", 1000), ("1 MB", 10**6), ("1GB", 10**9),
    ("2TB", 2 * 10**12), ("1KiB", 1024), ("256MiB", 256 * 2**20), ("256 mib", 256 * 2**20), ("1.5 GiB", 3 * 2**29),
    ("1TiB", 2**40), ("1.5e9", 1_500_000_000), ("4_096", 4096), ("1,000 B", 1000), (" 2MiB ", 2 * 2**20),
    ("1.9B", 1),
]


@pytest.mark.parametrize("text, n", SIZES)
def test_sizes_accepted(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text, message", [
    ("", "not a size"), ("lots", "not a size"), ("-1MB", "not a size"), ("12 parsecs", "unknown unit"),
    ("1k", "unknown unit"), ("1M", "unknown unit"), ("1 MB/s", "not a size"), ("0", "at least one byte"),
    ("0.5B", "at least one byte"), ("1e400", "too large"), (None, "a str"), (1024, "a str"),
])
def test_sizes_rejected(text, message):
    with pytest.raises(UsageError, match=message):
        parse_bytes(text)


@pytest.mark.parametrize("n, binary, decimal", [
    (0, "0 B", "0 B"), (512, "512 B", "512 B"), (1000, "1000 B", "1.0 KB"), (1024, "1.0 KiB", "1.0 KB"),
    (1536, "1.5 KiB", "1.5 KB"), (8_073_000, "7.7 MiB", "8.1 MB"), (70e9, "65.2 GiB", "70.0 GB"),
    (2**50, "1024.0 TiB", "1125.9 TB"),
])
def test_format_bytes(n, binary, decimal):
    assert format_bytes(n) == binary
    assert format_bytes(n, decimal=True) == decimal


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2**50), st.booleans())
def test_formatted_sizes_read_back_close(n, decimal):
    back = parse_bytes(format_bytes(n, decimal=decimal))
    assert back == pytest.approx(n, rel=0.05, abs=1)


# --- every caller uses these -------------------------------------------------------------------------------------


def test_callers_share_the_grammar():
    assert retention.parse_duration is units.parse_duration
    for text, seconds in DURATIONS:
        assert plan.parse_duration(text) == pytest.approx(seconds)
    for text, n in SIZES:
        assert plan.parse_bytes(text) == n
    assert plan.format_bytes(70e9) == "70.0 GB"
    assert plan.format_interval(5400) == "1h30m"
    assert plan.format_seconds(1400) == "1,400 s" and plan.format_seconds(0.28) == "0.28 s"


def test_plan_keeps_its_error_type():
    for parse, text in ((plan.parse_duration, "24 months"), (plan.parse_bytes, "12 parsecs")):
        with pytest.raises(PlanInputError):
            parse(text)


def test_cli_and_lock_messages_use_the_formats():
    from luopan.cli.app import human
    from luopan.repository.locks import STALE_SECONDS, _span

    assert human(8_073_000) == "7.7 MiB"
    assert _span(42.9) == "42s" and _span(-3) == "0s" and _span(7380) == "2h3m"
    assert parse_duration(_span(STALE_SECONDS)) == STALE_SECONDS

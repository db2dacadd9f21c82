"""Checkpoint cost planning: how big a checkpoint is, how long a save takes, what it costs at an interval.

The arithmetic of the reference article (``persistence-in-ai-engineering``, §3.1), computed instead of hand-made:

* **Size** = parameters × bytes per parameter. A checkpoint holds the weights (``bf16``/``fp16`` 2 B, ``fp32``
  4 B), an optional fp32 master copy (``master_weights="fp32"``, 4 B; mixed-precision trainers such as DeepSpeed
  ZeRO or Megatron keep one) and the optimizer state, always fp32: Adam 2 moments (8 B), SGD with momentum 1
  buffer (4 B), plain SGD or no optimizer 0 B. Gradients are not counted: they are recomputed every step and a
  ``state_dict`` does not hold them.
* **Time per save** C = size / write bandwidth (given, or measured by `probe_bandwidth`: an fsync'd write of a
  temporary file).
* **Overhead at interval T** = C / T (a synchronous save stalls training for C every T).
* **Young/Daly interval** for a mean time between failures M: T* = sqrt(2·C·M) (Young's first-order optimum).
  Its overhead is reported as C/T* + T*/(2·M): save time plus the expected lost work (on average half an
  interval is recomputed after a failure); at T* that is sqrt(2·C/M). Restart time is not counted.
* **Incremental** (LoRA, ``lora_fraction`` f): the trainable parameters are f × the model's parameters, and only
  they are rewritten per save, with their optimizer state and master copy: bytes per save = f × the full size.
  The frozen base (its weights only, no optimizer state) is written once, the first time, and not again; luopan's
  content addressing is what makes that true (unchanged chunks are never rewritten).

Units are decimal, like the article: 1 GB = 10^9 bytes, 1 MB/s = 10^6 bytes/s (``GiB``/``MiB/s`` are accepted
on input and mean 2^30 / 2^20). Sizes and durations are read and written by luopan.units (its grammar: ``2h``,
``45 min``, ``1h30m``; ``256MiB``, ``1GB``); this module converts their errors to PlanInputError.

**Reproducing the article.** The defaults (``bf16`` weights, ``adam``, ``master_weights="none"``: 10 B/param) are
the article's configuration. The article itemises 7B as 14 GB of weights + 56 GB of optimizer state (= 2 + 8
B/param) and then rounds up to "close to 80 GB" for unquantified "gradients and misc"; its 70B figure, 700 GB /
1,400 s at 500 MB/s, is exactly 10 B/param with nothing added. So 7B plans at 70 GB / 140 s / 1.9% every 2 h
(12.5% under the article's rounded ~80 GB / ~160 s / ~2.2%) and 70B at 700 GB / 1,400 s (exact; 9.7% every
4 h, the article's "close to 10%"). ``master_weights="fp32"`` (14 B/param: 98 GB, 980 GB) does not reproduce
the article; adding bf16 gradients (12 B/param) would fit its 7B figure but not its 70B one.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import units
from .errors import PlanInputError, ProbeError, UsageError

__all__ = [
    "Accounting", "PlanInputError", "ProbeError", "ProbeResult", "IntervalCost", "SaveCost", "ModelPlan",
    "parse_count", "parse_bytes", "parse_rate", "parse_duration", "parse_fraction",
    "young_daly_interval", "expected_overhead", "plan_model", "check_probe_dir", "probe_bandwidth",
    "format_bytes", "format_seconds", "format_interval", "format_count", "format_fraction",
]

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASTER_BYTES = {"none": 0, "fp32": 4}
# Optimizer state per parameter, in fp32 (PyTorch keeps it at the dtype of the fp32 params under AMP).
OPTIMIZER_BYTES = {"adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}
OPTIMIZER_TEXT = {"adam": "Adam 2×fp32 moments", "sgd-momentum": "SGD momentum fp32", "sgd": "SGD (no state)",
                  "none": "no optimizer"}


# ---------------------------------------------------------------------------------------------------- parsing

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]*)", text.strip().replace("_", "").replace(",", ""))
    if not m:
        raise PlanInputError(f"{text!r} is not a {what}; write it like {example}")
    return float(m.group(1)), m.group(2).lower()


def parse_count(text: str) -> float:
    """A parameter count: ``7B``, ``70b``, ``350M``, ``1.5e9``, ``1.2T``, ``7_000_000_000``. Positive."""
    value, unit = _split(text, "parameter count", "7B, 350M or 1.5e9")
    if unit not in _COUNT_SUFFIX:
        raise PlanInputError(f"{text!r}: unknown suffix {unit!r}; use K, M, B (billion) or T, e.g. 7B")
    n = value * _COUNT_SUFFIX[unit]
    if n < 1:
        raise PlanInputError(f"{text!r}: a model needs at least one parameter")
    return n


def parse_bytes(text: str) -> int:
    """A size: ``256MiB``, ``1GB``, ``4096`` (bytes). Decimal units are powers of 10, ``…iB`` powers of 2
    (luopan.units.parse_bytes, raising PlanInputError)."""
    try:
        return units.parse_bytes(text)
    except UsageError as exc:
        raise PlanInputError(str(exc)) from None


def parse_rate(text: str) -> float:
    """A write bandwidth in bytes per second: ``500MB/s``, ``1GB/s``, ``1.5 GiB/s``. The ``/s`` is required."""
    s = text.strip()
    if not s.lower().endswith("/s"):
        raise PlanInputError(f"{text!r} is not a bandwidth; write it like 500MB/s or 1GB/s")
    value, unit = _split(s[:-2], "bandwidth", "500MB/s or 1GB/s")
    if unit not in units.BYTE_UNITS or not unit:
        raise PlanInputError(f"{text!r}: unknown unit {unit!r}; use MB/s, GB/s (decimal) or MiB/s, GiB/s")
    rate = value * units.BYTE_UNITS[unit]
    if rate <= 0:
        raise PlanInputError(f"{text!r}: the bandwidth must be positive")
    return rate


def parse_duration(text: str) -> float:
    """A duration in seconds: ``2h``, ``30m``, ``90s``, ``1.5d``, ``1h30m``, ``45 min``. A unit is required
    (luopan.units.parse_duration, raising PlanInputError)."""
    try:
        return units.parse_duration(text)
    except UsageError as exc:
        raise PlanInputError(str(exc)) from None


def parse_fraction(text: str) -> float:
    """A fraction in (0, 1]: ``0.01`` or ``1%``."""
    s = text.strip()
    percent = s.endswith("%")
    try:
        value = float(s[:-1] if percent else s) / (100 if percent else 1)
    except ValueError:
        raise PlanInputError(f"{text!r} is not a fraction; write it like 0.01 or 1%") from None
    if not 0 < value <= 1:
        raise PlanInputError(f"{text!r}: the trainable fraction must be above 0 and at most 1 (100%)")
    return value


# ---------------------------------------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
    """Decimal units, as the article: ``70.0 GB``."""
    return units.format_bytes(n, decimal=True)


def format_count(n: float) -> str:
    """``7B``, ``70B``, ``1.5B``, ``350M``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.0f}"


format_seconds = units.format_seconds  # a save time as the article writes it: 140 s, 1,400 s, 0.28 s
format_interval = units.format_duration  # an interval: 2h, 30m, 1h22m, 90s, 2d12h


def format_fraction(x: float) -> str:
    """An overhead as a percentage: ``1.94%``. Over 100% means the saves take longer than the interval."""
    return f"{100 * x:#.3g}%"


# --------------------------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class Accounting:
    """What one parameter costs in a checkpoint. Refuses an fp32 master copy of fp32 weights (it is the same data)."""

    weights: str = "bf16"
    optimizer: str = "adam"
    master_weights: str = "none"

    def __post_init__(self) -> None:
        for name, table in (("weights", WEIGHT_BYTES), ("optimizer", OPTIMIZER_BYTES),
                            ("master_weights", MASTER_BYTES)):
            if getattr(self, name) not in table:
                raise PlanInputError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(table)}")
        if self.weights == "fp32" and self.master_weights == "fp32":
            raise PlanInputError("an fp32 master copy of fp32 weights counts the same tensor twice: choose master "
                                 "weights none, or bf16/fp16 weights")

    def bytes_per_param(self) -> dict[str, int]:
        b = {"weights": WEIGHT_BYTES[self.weights], "master_weights": MASTER_BYTES[self.master_weights],
             "optimizer": OPTIMIZER_BYTES[self.optimizer]}
        return b | {"total": sum(b.values())}

    def describe(self) -> str:
        b = self.bytes_per_param()
        parts = [f"{self.weights} weights {b['weights']}"]
        if b["master_weights"]:
            parts.append(f"fp32 master {b['master_weights']}")
        parts.append(f"{OPTIMIZER_TEXT[self.optimizer]} {b['optimizer']}")
        return f"{b['total']} B/param ({' + '.join(parts)})"


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimal checkpoint interval, sqrt(2·C·M)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def expected_overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float) -> float:
    """First-order expected overhead of saving every T under failures with mean time M: C/T + T/(2·M)."""
    return save_seconds / interval_seconds + interval_seconds / (2 * mtbf_seconds)


@dataclass(frozen=True)
class IntervalCost:
    """Saving every ``interval_s``: the save overhead C/T and, with an MTBF, the expected C/T + T/(2·M)."""

    interval_s: float
    save_fraction: float
    expected_fraction: Optional[float]


@dataclass(frozen=True)
class SaveCost:
    """One column of the plan: what each save writes and what it costs."""

    bytes_per_save: float
    seconds_per_save: float
    intervals: tuple[IntervalCost, ...]
    young_daly: Optional[IntervalCost]            # at T* = sqrt(2·C·M), when an MTBF is given
    once_bytes: float = 0.0                       # written once, not per save (the frozen base)

    def to_json(self) -> dict[str, Any]:
        return {"bytes_per_save": self.bytes_per_save, "seconds_per_save": self.seconds_per_save,
                "intervals": [vars(i) for i in self.intervals],
                "young_daly": None if self.young_daly is None else vars(self.young_daly)}


def _cost(nbytes: float, bandwidth: float, intervals: Sequence[float], mtbf: Optional[float],
          once_bytes: float = 0.0) -> SaveCost:
    c = nbytes / bandwidth

    def at(t: float) -> IntervalCost:
        return IntervalCost(t, c / t, expected_overhead(c, t, mtbf) if mtbf else None)

    return SaveCost(nbytes, c, tuple(at(t) for t in intervals),
                    at(young_daly_interval(c, mtbf)) if mtbf else None, once_bytes)


@dataclass(frozen=True)
class ModelPlan:
    """Full and (with a LoRA fraction) incremental costs of checkpointing one model size."""

    params: float
    accounting: Accounting
    full: SaveCost
    incremental: Optional[SaveCost]
    lora_fraction: Optional[float]
    mtbf: Optional[float] = None

    def columns(self) -> list[str]:
        """Headers of the value columns of `rows`."""
        inc = [] if self.lora_fraction is None else [f"incremental (LoRA {100 * self.lora_fraction:g}%)"]
        return ["full", *inc]

    def rows(self) -> list[tuple[str, list[str]]]:
        """The table as text: (label, one cell per column of `columns`), units formatted as the article."""
        cols = [self.full] + ([self.incremental] if self.incremental is not None else [])
        rows = [("written per save", [format_bytes(c.bytes_per_save) for c in cols])]
        if self.incremental is not None:
            rows.append(("written once (frozen base)", ["—", format_bytes(self.incremental.once_bytes)]))
        rows.append(("time per save", [format_seconds(c.seconds_per_save) for c in cols]))
        for i, every in enumerate(self.full.intervals):
            rows.append((f"save overhead every {format_interval(every.interval_s)}",
                         [format_fraction(c.intervals[i].save_fraction) for c in cols]))
        if self.mtbf is None:
            return rows + [("Young/Daly interval", ["give --mtbf" for _ in cols])]
        for i, every in enumerate(self.full.intervals):
            rows.append((f"expected overhead every {format_interval(every.interval_s)}",
                         [format_fraction(c.intervals[i].expected_fraction or 0) for c in cols]))
        yd = [c.young_daly for c in cols if c.young_daly is not None]
        rows.append((f"Young/Daly interval (MTBF {format_interval(self.mtbf)})",
                     [format_interval(y.interval_s) for y in yd]))
        rows.append(("expected overhead at Young/Daly", [format_fraction(y.expected_fraction or 0) for y in yd]))
        return rows

    def to_json(self) -> dict[str, Any]:
        inc = None
        if self.incremental is not None:
            assert self.lora_fraction is not None
            inc = self.incremental.to_json() | {
                "trainable_params": self.params * self.lora_fraction,
                "base_bytes_once": self.incremental.once_bytes}
        return {"params": self.params, "label": format_count(self.params), "full": self.full.to_json(),
                "incremental": inc}


def plan_model(params: float, accounting: Accounting, bandwidth: float, intervals: Sequence[float],
               mtbf: Optional[float] = None, lora_fraction: Optional[float] = None) -> ModelPlan:
    """Plan one model size. ``bandwidth`` in bytes/s, ``intervals`` and ``mtbf`` in seconds."""
    if bandwidth <= 0:
        raise PlanInputError("the bandwidth must be positive")
    if lora_fraction is not None and not 0 < lora_fraction <= 1:
        raise PlanInputError(f"lora_fraction={lora_fraction}: the trainable fraction must be in (0, 1], "
                             "e.g. 0.01 for 1%")
    per_param = accounting.bytes_per_param()
    full = _cost(params * per_param["total"], bandwidth, intervals, mtbf)
    inc = None
    if lora_fraction is not None:
        inc = _cost(params * lora_fraction * per_param["total"], bandwidth, intervals, mtbf,
                    once_bytes=params * per_param["weights"])
    return ModelPlan(params, accounting, full, inc, lora_fraction, mtbf)


# --------------------------------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class ProbeResult:
    path: str
    nbytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else math.inf


_PROBE_BLOCK = 4 * 2**20


def check_probe_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path if it is a directory the probe can write into; PlanInputError otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise PlanInputError(f"probe location {str(path)!r} is not a directory; give the directory checkpoints "
                             "will be written to")
    return directory


def probe_bandwidth(path: str | os.PathLike[str], nbytes: int,
                    progress: Optional[Callable[[int], None]] = None) -> ProbeResult:
    """Measure sequential write bandwidth into directory ``path``: write ``nbytes`` of random data to a temporary
    file (``.luopan-probe-*``), fsync it, and time write + fsync. The file is removed in every case, including an
    exception or KeyboardInterrupt raised mid-write (``progress`` is called with the bytes of each block written).
    Random bytes, so a compressing filesystem cannot flatter the figure. A probe much smaller than the page cache
    of a remote filesystem still measures the fsync; 256 MiB or more gives a steadier number.
    """
    directory = check_probe_dir(path)
    if nbytes < 1:
        raise PlanInputError("the probe size must be at least one byte")
    block = os.urandom(min(_PROBE_BLOCK, nbytes))
    try:
        fd, name = tempfile.mkstemp(prefix=".luopan-probe-", dir=directory)
    except OSError as exc:
        raise ProbeError(f"cannot create a probe file in {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        try:
            view = memoryview(block)
            start = time.perf_counter()
            left = nbytes
            while left:
                n = os.write(fd, view[:min(left, len(block))])
                left -= n
                if progress is not None:
                    progress(n)
            os.fsync(fd)
            seconds = time.perf_counter() - start
        except OSError as exc:
            raise ProbeError(f"probe write to {str(path)!r} failed: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
        os.unlink(name)  # also on KeyboardInterrupt: a probe never leaves its file behind
    return ProbeResult(str(directory), nbytes, seconds)

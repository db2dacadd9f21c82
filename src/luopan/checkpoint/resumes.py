"""The resume check: a run's per-step metrics and its resumes, journaled in the repository (no torch here).

"After recovery, run a few dozen steps and compare the loss with the original log." ``CheckpointManager`` journals
the metrics of every step the loop reports (``mgr.log``, ``mgr.maybe_save``) in the journal ``metrics-<run>``
(docs/format.md §16). When ``restore()`` resumes the run, the first ``ResumeCheck.steps`` steps the interrupted run
journaled after the restored step are compared with those the resumed run reports; the outcome — matched, diverged
at step S, or undecided (not enough steps) — is journaled in ``resumes-<run>``, one record when the resume starts and
one when it is decided. ``list_resumes(repo, run)`` reads them back. Journals need a local (or tiered) repository;
elsewhere the check is off, with a warning. A run name too long for the prefix gets a shortened, hashed journal name
(``journal_name``).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import blake3

from ..errors import JournalBusyError, LuopanError, UsageError
from .progress import logger

if TYPE_CHECKING:  # a kind imports no other kind: journals are opened through the Repo (``repo.journal``)
    from ..journal.api import Journal
    from ..repo import Repo

METRICS, RESUMES = "metrics-", "resumes-"
KEYS = ("step", "time", "restore_seconds", "matched", "first_divergent_step", "steps_compared")


@dataclass(frozen=True)
class ResumeCheck:
    """How a resume is checked: the first ``steps`` steps after the restored one are compared with the interrupted
    run's, metric by metric (``metrics``: the names to compare; default every metric both runs report for a step).
    Numbers agree when ``|resumed - original| <= atol + rtol * |original|`` (default 0 and 0: bit-for-bit, for a
    deterministic run; NaN agrees with NaN); other values when equal."""

    steps: int = 20
    rtol: float = 0.0
    atol: float = 0.0
    metrics: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise UsageError(f"ResumeCheck.steps must be an integer >= 1, not {self.steps!r}")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise UsageError(f"ResumeCheck.{name} must be a number >= 0, not {v!r}")

    def agree(self, original: Any, resumed: Any) -> bool:
        a, b = _number(original), _number(resumed)
        if a is None or b is None:
            return a is None and b is None and type(original) is type(resumed) and original == resumed
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(b - a) <= self.atol + self.rtol * abs(a)


def journal_name(prefix: str, run: str) -> str:
    """``prefix + run``, or, when that is longer than a journal name may be, ``prefix``, the run's first 100
    characters, ``-`` and 16 hex digits of the BLAKE3 of the run name."""
    name = prefix + run
    return name if len(name) <= 128 else f"{prefix}{run[:100]}-{blake3.blake3(run.encode()).hexdigest()[:16]}"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("NaN", "Infinity", "-Infinity"):
        return float(v.replace("Infinity", "inf"))
    return None


def json_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as a journal record holds them: numbers (tensors and NumPy scalars as Python numbers; non-finite
    floats as "NaN", "Infinity", "-Infinity"), str, bool, None; other values are left out."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            continue
        if hasattr(v, "item") and not isinstance(v, (str, bytes)):
            try:
                v = v.item()
            except (TypeError, ValueError, RuntimeError):  # a tensor of several elements
                continue
        if isinstance(v, float) and not math.isfinite(v):
            v = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
    return out


def list_resumes(repo: Repo | str | os.PathLike[str], run: str) -> list[dict[str, Any]]:
    """The resumes of ``run``, oldest first: dicts with ``step`` (the step resumed from), ``time`` (ISO 8601),
    ``restore_seconds``, ``matched`` (True, False, or None while undecided or when too few steps were compared),
    ``first_divergent_step`` (int or None), ``steps_compared``, and ``detail`` (what differed, or None). ``repo``: an
    open ``luopan.Repo`` or the path of one."""
    if isinstance(repo, (str, os.PathLike)):
        from ..repo import open as open_repo

        with open_repo(repo, create=False, replicate=False) as opened:
            return list_resumes(opened, run)
    try:
        journal = repo.journal(journal_name(RESUMES, run), read_only=True)
    except FileNotFoundError:  # never written: no resume recorded
        return []
    except UsageError:  # not a local repository: journals (and so resume records) cannot be there
        return []
    try:
        records: dict[int, dict[str, Any]] = {}
        for seq, rec in journal.items(journal.first_seq):
            if not isinstance(rec, dict):
                continue
            if "of" in rec:  # an outcome: completes the resume it names
                if rec["of"] in records:
                    records[rec["of"]].update({k: rec[k] for k in (*KEYS[3:], "detail") if k in rec})
            elif "step" in rec:
                records[seq] = {"matched": None, "first_divergent_step": None, "steps_compared": 0, "detail": None,
                                **{k: rec.get(k) for k in KEYS[:3]}}
        return list(records.values())
    finally:
        journal.close()


class RunJournal:
    """The metrics and resumes journals of one run, as a training loop writes them (see the module docstring)."""

    def __init__(self, repo: Repo, run: str, check: ResumeCheck) -> None:
        self.repo, self.run, self.check = repo, run, check
        self._metrics: Journal | None = None
        self._off = False
        self._expected: dict[int, dict[str, Any]] = {}  # step -> the interrupted run's metrics, while undecided
        self._compared: set[int] = set()
        self._resume: tuple[int, int] | None = None  # (seq of the resume record, step resumed from), while undecided

    def _journal(self) -> Journal | None:
        if self._metrics is None and not self._off:
            try:
                self._metrics = self.repo.journal(journal_name(METRICS, self.run), "batch")
            except (UsageError, JournalBusyError, OSError) as exc:
                self._off = True
                warnings.warn(f"run {self.run!r}: the resume check is off, its metrics journal cannot be written "
                              f"({exc}); pass resume_check=False to say so", stacklevel=4)
        return self._metrics

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Journal the metrics of ``step``; compare them with the interrupted run's while a resume is undecided."""
        values = json_metrics(metrics)
        if not values:
            return
        j = self._journal()
        if j is not None:
            try:
                j.append({"step": step, "metrics": values})
            except (OSError, LuopanError) as exc:  # context, not state: never fail the training step for it
                self._off = True
                warnings.warn(f"run {self.run!r}: metrics journal failed ({exc}); the resume check is off", stacklevel=3)
        if self._resume is not None:
            self._compare(step, values)

    def resumed(self, step: int, restore_seconds: float) -> None:
        """``restore()`` resumed the run from ``step`` (0: a new run): read what the interrupted run logged after it,
        record the resume, and start comparing."""
        self.decide_pending()
        j = self._journal()
        if j is None:
            return
        original = _logged_after(j, step) if step else {}  # step 0: a new run, nothing to compare with
        try:
            j.append({"resumed_from": step})  # the records after ``step`` before this belong to the interrupted run
        except (OSError, LuopanError):
            pass
        if step == 0:
            return
        window = sorted(original)[: self.check.steps]
        self._expected = {s: original[s] for s in window}
        self._compared = set()
        record = {"step": step, "time": datetime.now(timezone.utc).isoformat(),
                  "restore_seconds": round(restore_seconds, 6), "window": self.check.steps,
                  "rtol": self.check.rtol, "atol": self.check.atol}
        seq = self._append_resume(record)
        self._resume = (seq, step) if seq is not None else None
        if not self._expected:
            self._decide(None, None, f"the interrupted run logged no metrics after step {step}")

    def _compare(self, step: int, values: dict[str, Any]) -> None:
        if step in self._expected:
            original = self._expected[step]
            names = [k for k in (self.check.metrics or values) if k in values and k in original]
            for k in names:
                if not self.check.agree(original[k], values[k]):
                    self._decide(False, step, f"{k}: {values[k]!r} after the resume, {original[k]!r} originally")
                    return
            if names:
                self._compared.add(step)
            if self._compared == set(self._expected):
                self._decide(True, None, None)
        elif self._expected and step > max(self._expected):  # past the window: what was compared decides
            self._decide(True if self._compared else None, None,
                         None if self._compared else "no metric of the window's steps was logged again")

    def _decide(self, matched: bool | None, first: int | None, detail: str | None) -> None:
        assert self._resume is not None
        seq, step = self._resume
        self._resume, self._expected = None, {}
        self._append_resume({"of": seq, "matched": matched, "first_divergent_step": first,
                             "steps_compared": len(self._compared) + (first is not None), "detail": detail})
        where = f"run {self.run!r} resumed from step {step}"
        if matched is False:
            msg = (f"{where} diverged from the interrupted run at step {first} ({detail}): the resume is not exact "
                   "(state not restored, e.g. an RNG or the data position, or a nondeterministic step)")
            logger.warning("%s", msg)
            warnings.warn(msg, stacklevel=4)
        elif matched:
            logger.info("%s matches the interrupted run for %d steps", where, len(self._compared))
        else:
            logger.info("%s: not enough steps to compare (%s)", where, detail)

    def decide_pending(self) -> None:
        """A resume still undecided when the loop stops (or restores again) ends undecided: not enough steps."""
        if self._resume is not None:
            self._decide(None, None, f"the run stopped after {len(self._compared)} of the {len(self._expected)} "
                         "steps to compare (those agreed)" if self._compared
                         else "the run stopped before any step to compare was logged again")

    def _append_resume(self, record: dict[str, Any]) -> int | None:
        try:
            with self.repo.journal(journal_name(RESUMES, self.run), "always") as j:
                return j.append(record)
        except (OSError, LuopanError) as exc:
            warnings.warn(f"run {self.run!r}: the resume could not be recorded ({exc})", stacklevel=4)
            return None

    def close(self) -> None:
        try:
            self.decide_pending()
        finally:
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None


def _logged_after(j: Journal, step: int) -> dict[int, dict[str, Any]]:
    """step -> metrics the run logged for the steps after ``step``, as its latest life logged them (a resume marker
    drops what was logged after the step it resumed from: the steps were run again)."""
    out: dict[int, dict[str, Any]] = {}
    for rec in j.read(j.first_seq):
        if not isinstance(rec, dict):
            continue
        if "resumed_from" in rec:
            out = {s: m for s, m in out.items() if s <= rec["resumed_from"]}
        elif isinstance(rec.get("step"), int) and rec["step"] > step and isinstance(rec.get("metrics"), dict):
            out.setdefault(rec["step"], {}).update(rec["metrics"])
    return out

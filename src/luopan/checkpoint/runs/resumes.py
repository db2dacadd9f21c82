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
from typing import Any

from ...errors import JournalBusyError, LuopanError, UsageError
from ..progress import logger
from .journals import METRICS, RESUMES, journal_name


KEYS = ("step", "time", "restore_seconds", "matched", "first_divergent_step", "steps_compared")


@dataclass(frozen=True)
class ResumeCheck:
    """How a resume is checked: the first ``steps`` steps after the restored one are compared with the interrupted
    run's, metric by metric (``metrics``: the names to compare; by default the metrics whose name contains "loss"
    when a step has any — what a person compares by hand after a recovery; wall-clock figures such as step times or
    throughput never match — and otherwise every metric both runs report for the step). A step is compared with the
    last value logged for it, in both runs (gradient accumulation logs a step several times). Numbers agree when ``|resumed - original| <= atol + rtol * |original|`` (default 0 and 0: bit-for-bit, for a
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
        if isinstance(v, str) and not _encodable(v):  # lone surrogates: not JSON text a journal can hold
            continue
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
    return out


def _encodable(v: str) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def compared_names(check_metrics: tuple[str, ...] | None, original: dict[str, Any], values: dict[str, Any]
                   ) -> list[str]:
    """The metrics of a step that a resume compares (see ResumeCheck.metrics)."""
    if check_metrics is not None:
        return [k for k in check_metrics if k in values and k in original]
    shared = [k for k in values if k in original]
    losses = [k for k in shared if "loss" in k.lower()]
    return losses or shared


# What journaling may raise that must never reach the training loop: the check is context, not state.
_JOURNAL_ERRORS = (OSError, LuopanError, ValueError, TypeError)


def list_resumes(repo: Any, run: str) -> list[dict[str, Any]]:
    """The resumes of ``run``, oldest first: dicts with ``step`` (the step resumed from), ``time`` (ISO 8601),
    ``restore_seconds``, ``matched`` (True, False, or None while undecided or when too few steps were compared),
    ``first_divergent_step`` (int or None), ``steps_compared``, and ``detail`` (what differed, or None). ``repo``: an
    open ``luopan.Repo`` or the path of one."""
    if isinstance(repo, (str, os.PathLike)):
        from ...repo import open as open_repo

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

    def __init__(self, repo: Any, run: str, check: ResumeCheck) -> None:
        self.repo, self.run, self.check = repo, run, check
        self._metrics: Any = None  # a luopan.journal.Journal (opened through the Repo: a kind imports no other kind)
        self._off = False
        self._expected: dict[int, dict[str, Any]] = {}  # step -> the interrupted run's metrics, while undecided
        self._compared: set[int] = set()
        self._resume: tuple[int, int] | None = None  # (seq of the resume record, step resumed from), while undecided
        self._pending: tuple[int, dict[str, Any]] | None = None  # the step being logged (compared once it is done)

    def _journal(self) -> Any:
        if self._metrics is None and not self._off:
            try:
                self._metrics = self.repo.journal(journal_name(METRICS, self.run), "batch")
            except (UsageError, JournalBusyError, *_JOURNAL_ERRORS) as exc:  # e.g. a damaged journal
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
            except _JOURNAL_ERRORS as exc:  # context, not state: never fail the training step for it
                self._off = True
                warnings.warn(f"run {self.run!r}: metrics journal failed ({exc}); the resume check is off", stacklevel=3)
        if self._resume is not None:
            if self._pending is not None and self._pending[0] == step:
                self._pending[1].update(values)  # the same step again: its last values count
                return
            done, self._pending = self._pending, (step, dict(values))
            if done is not None:
                self._compare(*done)

    def resumed(self, step: int, restore_seconds: float) -> None:
        """``restore()`` resumed the run from ``step`` (0: a new run): read what the interrupted run logged after it,
        record the resume, and start comparing."""
        self.decide_pending()
        j = self._journal()
        if j is None:
            return
        try:
            original = _logged_after(j, step) if step else {}  # step 0: a new run, nothing to compare with
            j.append({"resumed_from": step})  # the records after ``step`` before this belong to the interrupted run
        except _JOURNAL_ERRORS as exc:  # a damaged or unreadable journal: no check, never a failed restore
            self._off = True
            warnings.warn(f"run {self.run!r}: the resume check is off, its metrics journal cannot be read ({exc})",
                          stacklevel=3)
            return
        if step == 0:
            return
        window = sorted(original)[: self.check.steps]
        self._expected = {s: original[s] for s in window}
        self._compared = set()
        self._pending = None
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
            names = compared_names(self.check.metrics, original, values)
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
        self._resume, self._expected, self._pending = None, {}, None
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
        if self._resume is not None and self._pending is not None:
            done, self._pending = self._pending, None
            self._compare(*done)  # the last step logged is complete now
        if self._resume is not None:
            self._decide(None, None, f"the run stopped after {len(self._compared)} of the {len(self._expected)} "
                         "steps to compare (those agreed)" if self._compared
                         else "the run stopped before any step to compare was logged again")

    def _append_resume(self, record: dict[str, Any]) -> int | None:
        try:
            with self.repo.journal(journal_name(RESUMES, self.run), "always") as j:
                return j.append(record)
        except (JournalBusyError, *_JOURNAL_ERRORS) as exc:
            warnings.warn(f"run {self.run!r}: the resume could not be recorded ({exc})", stacklevel=4)
            return None

    def close(self) -> None:
        try:
            self.decide_pending()
        finally:
            if self._metrics is not None:
                try:
                    self._metrics.close()
                except _JOURNAL_ERRORS as exc:
                    warnings.warn(f"run {self.run!r}: the metrics journal did not close cleanly ({exc})", stacklevel=3)
                self._metrics = None


def _logged_after(j: Any, step: int) -> dict[int, dict[str, Any]]:
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

"""One result of ``luopan doctor``: which check, ok/warn/fail, what was found and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STATUSES = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """``status``: "ok" (the check passed), "warn" (a problem that will make checkpoints fail or be lost, with the
    fix), "fail" (data is damaged: a newest checkpoint does not verify). ``fix`` is None for ok findings."""

    check: str
    status: str
    message: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")

    def line(self) -> str:
        """The finding as one line: ``message: fix``."""
        return f"{self.message}: {self.fix}" if self.fix else self.message

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status, "message": self.message, "fix": self.fix}


def ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)


def warn(check: str, message: str, fix: str) -> Finding:
    return Finding(check, "warn", message, fix)


def fail(check: str, message: str, fix: str) -> Finding:
    return Finding(check, "fail", message, fix)


def exit_code(findings: list[Finding]) -> int:
    """0 when every check passed, 3 when data is damaged (any "fail"), else 1 (a warning)."""
    if any(f.status == "fail" for f in findings):
        return 3
    return 1 if any(f.status == "warn" for f in findings) else 0


def plural(n: int, one: str, many: str | None = None) -> str:
    """``1 lock``, ``2 locks`` (``many`` when the plural is not ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


def listed(items: list[str], limit: int = 3) -> str:
    """Up to ``limit`` items joined with "; ", then how many more."""
    shown = "; ".join(items[:limit])
    return shown + (f"; … {len(items) - limit} more" if len(items) > limit else "")

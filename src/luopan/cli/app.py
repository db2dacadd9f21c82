"""The ``luopan`` Typer app and what every command shares: consoles, the repository option (``-r`` before or after
the command, or ``LUOPAN_REPO``), the one table from error classes to exit codes, output helpers.

Exit codes: 0 ok, 1 error, 2 usage (a bad flag, argument or name), 3 damaged data, 4 not found, 5 repository newer
than this luopan.
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..errors import (
    GcError,
    IntegrityError,
    InvalidNameError,
    LuopanError,
    ManifestNotFoundError,
    RepoNotFoundError,
    UnsupportedFormatError,
    UsageError,
)
from ..format import FORMAT_VERSION
from ..format.names import parse_ref_text
from ..repo import Repo
from ..repo import open as repo_open
from ..units import format_bytes



def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or odd stream
        return False


# Help and usage errors in rich panels only when both streams are terminals; piped (luopan ls --bogus 2>&1 | cat,
# luopan --help | less) they are click's plain text, without box characters.
MARKUP: Any = "rich" if _is_tty(sys.stdout) and _is_tty(sys.stderr) else None

app = typer.Typer(
    name="luopan",
    help="luopan (落盘): atomic, verified, incremental checkpoints for AI runs.",
    no_args_is_help=True,
    add_completion=True,  # luopan --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
    rich_markup_mode=MARKUP,
)
_WIDE = 1_000_000  # the width of output that is not a terminal: nothing wraps, no entry name is cut


def _console(stderr: bool = False) -> Console:
    """A console for stdout (or stderr). On a terminal: rich's colours and width. Piped or redirected: no colours,
    no wrapping at 80 columns (a command in an error message, a long entry name stay whole on one line). NO_COLOR
    (any value) turns colours off on a terminal too, as rich does."""
    if _is_tty(sys.stderr if stderr else sys.stdout):
        return Console(stderr=stderr, soft_wrap=stderr)
    return Console(stderr=stderr, soft_wrap=True, width=_WIDE, no_color=True, highlight=False,
                   color_system=None)


out = _console()
err = _console(stderr=True)


class _Table(Table):
    """A Table whose cells are shown as written: a ``str`` cell is literal text, never rich markup (a metric named
    ``loss[train]``, a path with ``[/x]``: user text everywhere)."""

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kwargs)


def table(*args: Any, title: str | None = None, **kwargs: Any) -> Table:
    """A rich Table: box characters on a terminal, plain space-separated columns when stdout is not one. Its title
    and cells are literal text (they hold names, paths, metrics), never markup; column headers are ours."""
    if not out.is_terminal:
        kwargs.setdefault("box", None)
    return _Table(*args, title=None if title is None else Text(title), **kwargs)

RepoOpt = Annotated[
    Optional[str],
    typer.Option("--repo", "-r", help="Repository path or URL (also accepted before the command, or set "
                                      "LUOPAN_REPO)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]

# The one table from error classes to exit codes, most specific first (luopan --help lists the codes). An invalid
# name, step or NAME@N (InvalidNameError) comes from what the user typed: a usage error (2), as a bad flag is.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, 2),
    (InvalidNameError, 2),
    (GcError, 3),
    (IntegrityError, 3),
    (RepoNotFoundError, 4),
    (ManifestNotFoundError, 4),
    (UnsupportedFormatError, 5),
    (LuopanError, 1),
    (OSError, 1),
)


def exit_code_for(exc: BaseException) -> int:
    """The CLI's exit code for an error (1 for anything the table does not name)."""
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), 1)


_root_repo: str | None = None  # set by the root callback from `luopan -r REPO COMMAND` or LUOPAN_REPO


def repo_location(repo: str | None) -> str:
    """The repository a command works on: its own ``-r``, else the one given before the command, else
    ``LUOPAN_REPO``. A usage error (exit 2) when there is none."""
    location = repo if repo is not None else _root_repo
    if not location:
        raise UsageError("no repository given: pass -r REPO (before or after the command) or set LUOPAN_REPO")
    return location


F = TypeVar("F", bound=Callable[..., Any])


_OS_ERRORS = {  # errno -> what a system error no luopan type names is called in the one-line message
    errno.ENOENT: "no such file or directory", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
    errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
    errno.EISDIR: "is a directory", errno.ENOTDIR: "not a directory", errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long", errno.EIO: "input/output error",
}


def error_message(exc: BaseException) -> str:
    """The one line a CLI error prints: a luopan error's own message (without Python's ``[Errno N]`` prefix); for
    a plain OSError, what happened and the path (``permission denied: /data/x``, ``disk full: /data/x``)."""
    if isinstance(exc, OSError) and not isinstance(exc, LuopanError):
        what = _OS_ERRORS.get(exc.errno or 0) or exc.strerror or type(exc).__name__
        paths = [os.fsdecode(p) for p in (exc.filename, exc.filename2) if p is not None]
        return what + (f": {' -> '.join(paths)}" if paths else "")
    if isinstance(exc, OSError) and exc.strerror and exc.errno is not None and exc.args and exc.args[0] == exc.errno:
        return exc.strerror + (f": {os.fsdecode(exc.filename)}" if exc.filename is not None and
                               os.fsdecode(exc.filename) not in exc.strerror else "")
    return str(exc)


def handles_errors(fn: F) -> F:
    """Print a luopan (or system) error as one ``error:`` line and exit with its code from EXIT_CODES."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (LuopanError, OSError) as exc:  # OSError: a system error no luopan type names (writing an output)
            err.print(f"[bold red]error:[/] {escape(error_message(exc))}", highlight=False, markup=True)
            raise typer.Exit(exit_code_for(exc)) from None

    return wrapper  # type: ignore[return-value]


@contextmanager
def usage_errors() -> Iterator[None]:
    """Within: an invalid name or number (InvalidNameError) comes from what the user typed, so it is a usage error
    (UsageError, exit 2), as a bad flag is."""
    try:
        yield
    except InvalidNameError as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(str(exc)) from None


def ref_argument(text: str, what: str = "reference") -> tuple[str, int]:
    """The CLI's one parser of a NAME@N argument (RUN@STEP, NAME@V) -> (NAME, N); a malformed one (``ds@x``,
    ``ds@-1``, no '@') is a usage error: exit 2 with the message."""
    with usage_errors():
        return parse_ref_text(text, what)


def open_repo(repo: str, **options: Any) -> Repo:
    """An existing repository; a tiered one reads through its tiers but replicates nothing from the CLI."""
    return repo_open(repo, create=False, replicate=False, **options)


def open_or_create_repo(repo: str) -> Repo:
    """The repository at ``repo``, created when missing with the default options, as ``luopan.open(path)`` does (a
    note on stderr says so: a mistyped path shows at once); ``luopan init`` creates one with other options."""
    try:
        return open_repo(repo)
    except RepoNotFoundError:
        r = repo_open(repo, replicate=False)
        err.print(f"[yellow]note:[/] created a luopan repository at {escape(r.store.describe())}", highlight=False)
        return r


def opens_repo(fn: F) -> F:
    """The one decorator of a command that works on an existing repository. The command declares ``r: Repo``;
    the CLI shows it as the ``-r/--repo`` option (also before the command, or LUOPAN_REPO: repo_location), opens
    the repository before the body runs and closes it after, and maps errors to exit codes (handles_errors). A
    missing repository is RepoNotFoundError (exit 4), naming the path."""
    return _repo_command(fn, open_repo)


def creates_repo(fn: F) -> F:
    """``opens_repo`` for a command that adds data (``artifact commit``): a missing repository is created first,
    as ``luopan.open(path)`` does in Python (open_or_create_repo)."""
    return _repo_command(fn, open_or_create_repo)


def _repo_command(fn: F, opener: Callable[[str], Repo]) -> F:
    sig = inspect.signature(fn, eval_str=True)  # typer reads the annotations of __signature__ as given
    if "r" not in sig.parameters:
        raise TypeError(f"{fn.__name__}: a command that opens a repository takes r: Repo")
    params = [p.replace(name="repo", annotation=RepoOpt, default=None) if p.name == "r" else p
              for p in sig.parameters.values()]

    @functools.wraps(fn)
    def wrapper(*args: Any, repo: str | None = None, **kwargs: Any) -> Any:
        r = opener(repo_location(repo))
        try:
            return fn(*args, r=r, **kwargs)
        finally:
            r.close()

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return handles_errors(wrapper)  # type: ignore[arg-type]


def not_found(msg: str) -> int:
    err.print(f"[bold red]error:[/] {escape(msg)}")
    return 4


def report_strays(r: Repo, run: str | None = None) -> None:
    """A line on stderr when the repository holds entries that are not luopan's (skipped by every command), and one
    when part of it cannot be read (a dangling link, an unreadable directory: checkpoints there are not seen)."""
    strays = r.checkpointing.strays(run)
    for unreadable, what in ((True, "cannot be read (checkpoints there are not listed, and gc will not run)"),
                             (False, "are not luopan's and were skipped")):
        group = [s for s in strays if s.unreadable == unreadable]
        if group:
            shown = "; ".join(str(s) for s in group[:3]) + (f"; … {len(group) - 3} more" if len(group) > 3 else "")
            err.print(f"[yellow]note:[/] {len(group)} entr{'y' if len(group) == 1 else 'ies'} {what}: "
                      f"{escape(shown)} (`luopan verify` lists them)", highlight=False)


human = format_bytes  # a size for people, binary units: 512 B, 1.5 MiB (luopan.units.format_bytes)


def print_plan(decided: Any, what: str, name: str, dry_run: bool, as_json: bool) -> None:
    """A prune's plan (luopan.retention.Plan) for ``what`` ("run", "artifact") ``name``, as JSON or lines."""
    if as_json:
        emit_json({what: name, "dry_run": dry_run, "keep": {str(k): v for k, v in decided.keep.items()},
                   "remove": decided.remove})
        return
    for line in decided.describe():
        out.print(line, highlight=False, markup=False)
    if dry_run:
        out.print("dry run: nothing removed")


def ratio(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.1f}×"


# The one definition of the dedup ratio `du` and `stats` show (repository.usage), quoted in both --help texts.
DEDUP_DEFINITION = ("Dedup ratio = logical bytes (what restoring them would write) / stored bytes (the distinct "
                    "chunks they reference, as stored: compressed). Manifests, the index, refs and pack bytes no "
                    "manifest references (gc frees them) are on storage but not in the ratio.")


def dedup_ratio(logical: int, stored: int) -> float | None:
    """``DEDUP_DEFINITION``'s ratio, rounded for JSON; None when nothing is stored."""
    return round(logical / stored, 4) if stored else None


def dedup_text(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}×"


def json_ratio(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 4)


def metrics_text(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return None
    raise TypeError(type(o).__name__)


def json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_safe(x) for x in v]
    return v


def _version(value: bool) -> None:
    if value:
        out.print(f"luopan {__version__} (reads repository formats 1-{FORMAT_VERSION})")
        raise typer.Exit()


@app.callback()
def _root(
    repo: Annotated[Optional[str], typer.Option(
        "--repo", "-r", envvar="LUOPAN_REPO", show_envvar=True,
        help="Repository path or URL for the command that follows (restic/borg style: luopan -r REPO ls).")] = None,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """luopan (落盘): atomic, verified, incremental checkpoints for AI runs.

    Exit codes: 0 ok, 1 error, 2 usage (a bad flag, argument or name), 3 damaged data, 4 not found, 5 repository
    newer than this luopan.
    """
    global _root_repo
    _root_repo = repo
    warnings.showwarning = _show_warning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """Warnings as one line on stderr (``warning: …``), not Python's two-line form with a source line."""
    err.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False)

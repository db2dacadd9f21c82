"""The CLI's one grammar for naming what a command works on, and its deprecated spellings.

A checkpoint is ``RUN@STEP`` (``RUN`` alone: the run's latest step, where the command takes one); an artifact or
index version is ``NAME@V``. Every command parses them here, through the one parser of ``NAME@N``
(luopan.format.names.parse_ref_text via app.ref_argument): a malformed reference is a usage error, exit 2.

The spellings this replaces (``RUN STEP`` as two arguments, ``--step N``, and flags renamed so that each flag name
means one thing across commands) still work for one release; each use prints one ``deprecated:`` line on stderr
naming the new spelling, except under --json (as every note: machine output stays parseable where a script
reads stdout and stderr together).
"""

from __future__ import annotations

from typing import Annotated, Optional, TypeVar

import typer

from ..errors import UsageError
from .app import err, escape, ref_argument

T = TypeVar("T")

RUN_REF = "RUN[@STEP]"  # the metavar of a checkpoint reference
NEXT_RELEASE = "it goes away in the next release"

RunRef = Annotated[str, typer.Argument(metavar=RUN_REF, show_default=False,
                                       help="The checkpoint: RUN@STEP, or RUN alone for its latest step.")]
# the deprecated second argument of `RUN STEP`: hidden from --help, still accepted (checkpoint_ref notes it)
LegacyStep = Annotated[Optional[int], typer.Argument(hidden=True, show_default=False,
                                                     help="Deprecated: give RUN@STEP.")]


def deprecated(old: str, new: str, quiet: bool = False) -> None:
    """One line on stderr: the spelling ``old`` still works this release; ``new`` is the one to use. ``quiet``
    (--json): nothing."""
    if not quiet:
        err.print(f"[yellow]deprecated:[/] {escape(old)}: use {escape(new)} instead ({NEXT_RELEASE})", highlight=False)


def parse_ref(text: str, what: str = "checkpoint (RUN@STEP)") -> tuple[str, Optional[int]]:
    """``NAME`` -> (NAME, None); ``NAME@N`` -> (NAME, N). A malformed one (``a@x``, ``a@``, ``a@1@2``) is a usage
    error (exit 2). The name itself is checked by whoever uses it (a run, an artifact, an index)."""
    if "@" not in text:
        return text, None
    return ref_argument(text, what)


def checkpoint_ref(text: str, legacy_step: Optional[int] = None, command: str = "",
                   old: str = "RUN STEP", quiet: bool = False,
                   what: str = "checkpoint (RUN@STEP)") -> tuple[str, Optional[int]]:
    """A command's ``RUN[@STEP]`` argument -> (RUN, STEP or None), with the deprecated spelling ``old`` (``RUN
    STEP``, ``RUN --step STEP``, ``NAME V``): ``legacy_step`` is its number, accepted with a note. A number given
    both ways is a usage error."""
    run, step = parse_ref(text, what)
    if legacy_step is None:
        return run, step
    if step is not None:
        raise UsageError(f"the number after '@' is given twice: {text} and {legacy_step}; give {text} alone")
    deprecated(f"luopan {command} {old}", f"luopan {command} {run}@{legacy_step}", quiet)
    return run, legacy_step


def renamed(new_value: Optional[T], old_value: Optional[T], old_flag: str, new_flag: str,
            quiet: bool = False) -> Optional[T]:
    """The value of a renamed flag: the new one, or the old (hidden) one with a note; both given is a usage
    error."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise UsageError(f"{old_flag} is the old name of {new_flag}: give {new_flag} alone")
    deprecated(old_flag, new_flag, quiet)
    return old_value


def required(value: Optional[T], flag: str) -> T:
    """A flag that must be given (declared optional only so that its deprecated old name can stand in)."""
    if value is None:
        raise UsageError(f"missing option {flag}")
    return value

"""Crash-point hook for tests of the commit protocol.

With ``LUOPAN_CRASH_AT=<point>`` in the environment, the process exits immediately (``os._exit(97)``, no cleanup,
like a kill) when it reaches that named point. Points are ``<file kind>.<step>`` with kinds ``pack``, ``index``,
``manifest``, ``ref`` and steps ``written`` (bytes written, not yet fsync'd), ``fsynced``, ``renamed``
(visible under its final name, directory not yet fsync'd), ``dirsynced``; plus ``chunk.written`` after the first
blob of a save is handed to the pack writer.
"""

from __future__ import annotations

import os

CRASH_EXIT_CODE = 97
_POINT = os.environ.get("LUOPAN_CRASH_AT") or None


def crashpoint(name: str) -> None:
    if _POINT is not None and name == _POINT:
        os._exit(CRASH_EXIT_CODE)

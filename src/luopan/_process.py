"""Whether a process of this host (and pid namespace) is running: the one liveness check of locks, temporary files
and replication markers."""

from __future__ import annotations

import os


def pid_alive(pid: object) -> bool:
    """True when ``pid`` names a running process here (or one we may not signal); False for a pid that is not a
    pid_t (names and records are not trusted: 0, -1 and huge numbers never reach ``kill``)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""What a manifest records about the saving process: library versions, host, code version."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys
from typing import Any

import numpy as np


def environment() -> dict[str, Any]:
    env = {
        "host": socket.gethostname(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        env["torch"] = str(torch.__version__)
    return env


@functools.lru_cache(maxsize=8)
def _code_version(cwd: str) -> dict[str, Any] | None:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "--verify", "-q", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": bool(status and status.strip())}


def code_version() -> dict[str, Any] | None:
    """git HEAD and dirty flag of the current directory's work tree, or None outside one. Cached per process."""
    return _code_version(os.getcwd())

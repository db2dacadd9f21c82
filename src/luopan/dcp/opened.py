"""The repositories ``luopan.dcp.Writer`` opened from a path or URL, kept open between saves of this process.

A Writer given a path used to open the repository afresh at every save: every index file read and parsed again, every
pack's trailer re-checked, and the XXH3 reuse of the previous save's chunk addresses (docs/format.md §5.1, kept on the
open repository) lost — a D2 re-save (benchmarks/dist.py) spent ~10 ms of its ~40 ms there. Kept open, the next save
finds its chunk index, its memory of intact packs and its rows in memory (the chunk index still picks up index files
new since, and forgets everything when gc consolidated them).

A kept repository is handed out again only when the config at its location is still the one it opened (a repository
removed and created again at the same path has another ``repo_id``), and only to one save at a time (a save in flight,
e.g. a ``dcp.async_save`` on its thread, leaves the next one a repository of its own). Only the last few locations
are kept; one dropped from the list is not closed (a save may still use it), as Writers never closed theirs before.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

from ..errors import LuopanError
from ..format.config import RepoConfig
from ..format.limits import MAX_CONFIG_BYTES
from ..format.names import CONFIG_KEY
from ..repo import Repo, open as open_repo

KEEP = 4  # locations kept open

_LOCK = threading.Lock()
_KEPT: OrderedDict[str, Repo] = OrderedDict()
_BUSY: set[int] = set()  # id() of kept repositories a save is using


def _key(location: Any) -> str | None:
    if isinstance(location, (str, os.PathLike)):
        text = os.fsdecode(os.fspath(location))
        return text if "://" in text else os.path.abspath(text)
    return None


def _current(repo: Repo) -> bool:
    """Whether the repository at ``repo``'s location is still the one it opened (same config)."""
    try:
        data = repo.store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
        return RepoConfig.from_bytes(data, repo.where) == repo.config
    except (LuopanError, OSError):
        return False


def acquire(location: Any) -> Repo:
    """The repository at ``location`` (a Repo is returned as it is), for one save: call ``release`` when its chunks
    are stored."""
    if isinstance(location, Repo):
        return location
    key = _key(location)
    if key is None:
        return open_repo(location, create=True)
    with _LOCK:
        repo = _KEPT.get(key)
        if repo is not None and id(repo) not in _BUSY:
            _BUSY.add(id(repo))
        else:
            repo = None
    if repo is not None:
        if _current(repo):
            with _LOCK:
                _KEPT.move_to_end(key)
            return repo
        with _LOCK:
            _BUSY.discard(id(repo))
            if _KEPT.get(key) is repo:
                del _KEPT[key]
    repo = open_repo(location, create=True)
    with _LOCK:
        if key not in _KEPT:  # (a kept one in use stays kept: this one serves one save)
            _KEPT[key] = repo
            _BUSY.add(id(repo))
            while len(_KEPT) > KEEP:
                _old_key, old = _KEPT.popitem(last=False)
                _BUSY.discard(id(old))
    return repo


def release(repo: Repo) -> None:
    """The save that acquired ``repo`` no longer stores chunks through it: the next save may have it."""
    with _LOCK:
        _BUSY.discard(id(repo))


def forget() -> None:
    """Drop every kept repository (tests)."""
    with _LOCK:
        _KEPT.clear()
        _BUSY.clear()

"""Opening a repository: the store for a path or URL, its config (created with the given options when missing), and
the checks every open makes (docs/format.md §3)."""

from __future__ import annotations

import math
import numbers
import os
import sys
from typing import Any

from ..errors import (
    ConfigConflictError,
    LuopanError,
    NotARepositoryError,
    RepoExistsError,
    RepoNotFoundError,
    UsageError,
)
from ..format import ENGINE2_FORMAT_VERSION, ROWMAP_FORMAT_VERSION
from ..format.config import DEFAULT_COMPRESSION, Compression, RepoConfig
from ..format.limits import MAX_CONFIG_BYTES
from ..format.names import CONFIG_KEY
from ..store import FsspecStore, MemoryStore, Store, is_object_url, open_store
from ..store.base import KeyNotFound
from ..store.local import TMP_MARK, LocalStore
from .tiersetup import TierSetup, setup


def is_number(x: object) -> bool:
    """A real number (NumPy scalars too), not a bool, not NaN."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


def check_open_options(lock_timeout: float | None, space_margin: float) -> None:
    if sys.byteorder != "little":  # docs/format.md §5: entries are stored little-endian, as in host memory
        raise LuopanError("luopan repositories are little-endian; this big-endian host cannot read or write them")
    if lock_timeout is not None and not (is_number(lock_timeout) and lock_timeout >= 0):
        raise UsageError(f"lock_timeout must be a number of seconds >= 0 (or None to wait forever), got "
                         f"{lock_timeout!r}")
    if not (is_number(space_margin) and 0 <= space_margin < math.inf):
        raise UsageError(f"space_margin must be a finite number >= 0 (0 turns the free-space check off), got "
                         f"{space_margin!r}")


def connect(
    location: str | os.PathLike[str] | Store,
    *,
    create: bool,
    chunk_size: int | None,
    pack_size: int | None,
    compression: str | Compression | None,
    replicate_to: str | os.PathLike[str] | Store | None,
    local_retention: Any,
    cold: Any,
    storage_options: dict[str, Any] | None,
) -> tuple[Store, RepoConfig, TierSetup | None]:
    """(store, config, tiering) of the repository at ``location``; see ``luopan.open`` for the options."""
    store = open_store(location, **(storage_options or {}) if is_object_url(location) else {})
    check_local_root(store, create)
    tiering = setup(store, replicate_to=replicate_to, local_retention=local_retention, cold=cold,
                    storage_options=storage_options)
    tiers = [] if tiering is None else [t for t in (tiering.store.remote, tiering.store.cold) if t is not None]
    if storage_options and not is_object_url(location) and not any(isinstance(t, FsspecStore) for t in tiers):
        raise UsageError(f"storage_options apply to object-store URLs (s3://…), and neither {location!r} nor a "
                         "replicate_to/cold URL (given or recorded) is one")
    where = store.describe()
    try:
        config = RepoConfig.from_bytes(store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), where)
    except KeyNotFound:
        if not create:
            raise RepoNotFoundError(
                f"no luopan repository at {where}: create one with `luopan init -r {where}` or luopan.open(path)"
            ) from None
        remote = tiering.store.remote if tiering is not None else None
        config = create_config(store, chunk_size, pack_size, compression, remote=remote)
    else:
        check_options(config, where, chunk_size, pack_size, compression)
    store.cleanup_temporaries()
    return (tiering.store if tiering is not None else store), config, tiering


def check_local_root(store: Store, create: bool) -> None:
    """A local repository path must be a directory (or not exist yet, when creating): a regular file there is a
    clear error, not a traceback from deep inside the store."""
    if not isinstance(store, LocalStore):
        return
    root = store.root
    if os.path.exists(root) and not os.path.isdir(root):
        raise (NotARepositoryError if create else RepoNotFoundError)(
            f"{root} is a file, not a luopan repository (a directory): pass the repository's directory with -r, "
            "or a new path to create one there")
    if not os.path.exists(root) and os.path.lexists(root):
        raise RepoNotFoundError(f"{root} is a dangling symbolic link (to {os.readlink(root)}): mount or restore "
                                "what it points to, or remove the link")


def check_new(location: str | os.PathLike[str] | Store) -> Store:
    """The store for ``init``: RepoExistsError if a repository is already there."""
    store = open_store(location)
    check_local_root(store, True)
    if store.exists(CONFIG_KEY):
        raise RepoExistsError(f"a luopan repository already exists at {store.describe()}")
    return store


def check_options(config: RepoConfig, where: str, chunk_size: int | None, pack_size: int | None,
                  compression: str | Compression | None) -> None:
    """ConfigConflictError when an option given differs from the existing repository's config."""
    wanted = {"chunk_size": chunk_size, "pack_size": pack_size,
              "compression": Compression.parse(compression) if compression is not None else None}
    for name, value in wanted.items():
        if value is not None and value != getattr(config, name):
            raise ConfigConflictError(
                f"repository {where} has {name}={getattr(config, name)}, not {value}; "
                "options apply only when a repository is created"
            )


def adopt_config(store: Store, remote: Store) -> RepoConfig | None:
    """A new local tier of a repository its remote already holds (another node of a collective job, a replaced
    machine, docs/format.md §10.2): the remote's ``luopan.json`` written locally (the same ``repo_id``), or None
    when the remote holds none or cannot be reached (a new repository is created then)."""
    try:
        data = remote.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
    except (KeyNotFound, OSError):
        return None
    RepoConfig.from_bytes(data, remote.describe())  # never copy a damaged config
    if not store.put_if_absent(CONFIG_KEY, data):  # another process created it first
        data = store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES)
    return RepoConfig.from_bytes(data, store.describe())


def create_config(store: Store, chunk_size: int | None, pack_size: int | None,
                  compression: str | Compression | None, remote: Store | None = None) -> RepoConfig:
    store.cleanup_temporaries()  # e.g. the config's own temp file from a creation that crashed
    root = getattr(store, "root", None)
    if root is not None and os.path.isdir(root) and any(TMP_MARK not in e.name for e in os.scandir(root)):
        if store.exists(CONFIG_KEY):  # another process (a rank opening the same new path) created it meanwhile
            return RepoConfig.from_bytes(store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), store.describe())
        raise NotARepositoryError(
            f"{root} exists, is not empty and is not a luopan repository: refusing to create one there; "
            "choose an empty or new directory"
        )
    if root is None and not isinstance(store, MemoryStore):  # an object-store prefix (or another backend)
        stray = next(iter(store.list("")), None)
        if stray is not None:
            raise NotARepositoryError(
                f"{store.describe()} already holds objects (e.g. {stray!r}) and is not a luopan repository: "
                "refusing to create one there; choose an empty prefix (e.g. s3://bucket/new-prefix)"
            )
    adopted = adopt_config(store, remote) if remote is not None else None
    if adopted is not None:
        check_options(adopted, store.describe(), chunk_size, pack_size, compression)
        return adopted
    comp = Compression.parse(DEFAULT_COMPRESSION if compression is None else compression)
    # the oldest version that describes the config (docs/format.md §1): "auto" writes blobs older luopan cannot read,
    # so such a repository is also created at the newest version (8): its checkpoint manifests store their entries in
    # groups (§8.5, 6) and row deltas in segments (§5.2, 7), its index snapshots row maps (§17.7, 8); "none" and
    # "zstd" keep version 1, readable by every luopan
    version = ROWMAP_FORMAT_VERSION if comp.format_version >= ENGINE2_FORMAT_VERSION else comp.format_version
    kwargs: dict[str, Any] = {"compression": comp, "format_version": version}
    if chunk_size is not None:
        kwargs["chunk_size"] = chunk_size
    if pack_size is not None:
        kwargs["pack_size"] = pack_size
    config = RepoConfig(**kwargs)
    if not store.put_if_absent(CONFIG_KEY, config.to_bytes()):  # another process created it first
        config = RepoConfig.from_bytes(store.get_limited(CONFIG_KEY, MAX_CONFIG_BYTES), store.describe())
    return config

"""Setting up a tiered repository (docs/format.md §10.2): the options of ``luopan.open``, the recorded settings.

    repo = luopan.open("ckpts", replicate_to="s3://bucket/ckpts", local_retention=luopan.retention.KeepLast(2),
                       cold=luopan.ColdPolicy("s3://archive/ckpts", older_than="7d"))

``setup`` turns the options (and what ``tier/config.json`` recorded) into a TieredStore before the repository is
opened on it; ``attach`` gives the opened repository its Tier (tier.py) and starts replication. ``ColdPolicy``, the
public cold-tier option, is defined with the cold moves (coldmoves.py) and re-exported here.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import (
    ArgumentTypeError,
    ConfigConflictError,
    CorruptRepoError,
    InvalidNameError,
    UsageError,
)
from ..format import BASE_FORMAT_VERSION
from ..format.canonical import seal, unseal_file
from ..format.limits import MAX_SMALL_BYTES
from ..format.names import TIER_CONFIG_KEY
from ..retention import Retention, RetentionRule
from ..store import FsspecStore, Store, is_object_url, open_store
from ..store.base import KeyNotFound
from ..store.tiered import TieredStore
from .coldmoves import ColdPolicy
from .kinds import Opened
from .replication import ensure_repository
from .tier import Tier

R = TypeVar("R", bound=Opened)


@dataclass
class TierSetup:
    """What ``setup`` decided: the store to open the repository on, the settings to record, the remote's URL as
    shown (None without a remote), the local retention rules and the cold policy."""

    store: TieredStore
    settings: dict[str, Any]
    url: str | None
    local_retention: Any
    cold: ColdPolicy | None


def check_local_retention(rules: Any) -> None:
    """InvalidNameError unless ``rules`` is a retention rule or a non-empty iterable of them."""
    try:
        if isinstance(rules, RetentionRule):
            return
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise ArgumentTypeError(f"got {type(rules).__name__}")
        if not Retention(*rules).rules:
            raise UsageError("no rule given")
    except (TypeError, ValueError) as exc:
        raise InvalidNameError(
            f"local_retention must be luopan.retention rules, e.g. KeepLast(2) | KeepBest(1, 'loss'): {exc}"
        ) from None


def setup(location: Store, *, replicate_to: Any, local_retention: Any, cold: ColdPolicy | None,
          storage_options: dict[str, Any] | None) -> TierSetup | None:
    """The TieredStore for ``open(location, replicate_to=…, cold=…)``, or None for an untiered repository.

    ``replicate_to=None`` uses the remote recorded in ``tier/config.json`` by an earlier tiered open; a URL given
    is recorded there (a different one than recorded is refused); so is a cold policy given by URL.
    """
    if local_retention is not None:
        check_local_retention(local_retention)
    if isinstance(location, TieredStore):
        return TierSetup(location, {}, None, local_retention, cold)
    recorded = read_tier_config(location) or {}
    settings: dict[str, Any] = {}
    url = replicate_to
    if url is None:
        url = recorded.get("replicate_to")
    elif not isinstance(url, Store):
        url = os.fspath(url)
        if recorded.get("replicate_to") not in (None, url):
            raise ConfigConflictError(
                f"{location.describe()} replicates to {recorded['replicate_to']}, not {url}; to change the remote, "
                f"delete {TIER_CONFIG_KEY} there (everything is then replicated again to the new remote)")
        settings["replicate_to"] = url
    if cold is None and recorded.get("cold"):
        c = recorded["cold"]
        cold = ColdPolicy(c["url"], c.get("older_than", "7d"))
    elif cold is not None:
        if not isinstance(cold, ColdPolicy):
            raise ArgumentTypeError(f"cold must be a luopan.ColdPolicy, got {type(cold).__name__}")
        cold.seconds  # noqa: B018 - validates the threshold now
        if isinstance(cold.url, str):
            settings["cold"] = {"url": cold.url, "older_than": cold.older_than}
    if local_retention is not None and url is None:
        raise ConfigConflictError("local_retention needs replicate_to: local copies are evicted only once the "
                                  "remote has them")
    if url is None and cold is None:
        return None
    remote = open_tier(url, storage_options, "replicate_to") if url is not None else None
    cold_store = None
    if cold is not None:
        cold_store = open_tier(cold.url, cold.storage_options or storage_options, "the cold URL")
    for tier, what in ((remote, "replicate_to"), (cold_store, "the cold URL")):
        if tier is not None and same_place(location, tier):
            raise ConfigConflictError(f"{what} ({tier.describe()}) is the repository itself or inside it "
                                      f"({location.describe()}): replicate to another place")
    if remote is not None and cold_store is not None and same_place(remote, cold_store):
        raise ConfigConflictError(f"the cold URL ({cold_store.describe()}) is the replication target itself")
    shown = url if isinstance(url, str) else (remote.describe() if remote is not None else None)
    return TierSetup(TieredStore(location, remote, cold_store), settings, shown, local_retention, cold)


def attach(repo: R, tiering: TierSetup, *, start: bool = True) -> R:
    """Give an opened repository its Tier (``repo.tier``): check (or create) the remote repository where it can be
    reached now, record the settings in ``tier/config.json``, and start replication (``start``)."""
    store = tiering.store
    if store.remote is not None:
        try:
            ensure_repository(store.local, store.remote)
        except ConfigConflictError:
            raise
        except OSError as exc:  # unreachable now: the replication thread keeps trying
            warnings.warn(f"the remote {store.remote.describe()} cannot be reached ({exc}); everything is kept "
                          "locally and replicated once it can", stacklevel=3)
    record_settings(store.local, tiering.settings)
    tier = Tier(repo, store, replicate_to=tiering.url, local_retention=tiering.local_retention, cold=tiering.cold)
    repo.tier = tier
    store.markers_of = tier.markers_of  # existence of evicted and cold manifests is answered locally
    if start:
        tier.start()
    return repo


def open_tier(location: str | os.PathLike[str] | Store, options: dict[str, Any] | None, what: str) -> Store:
    if isinstance(location, Store):
        return location
    loc = os.fspath(location)
    if not loc:
        raise InvalidNameError(f"{what} must be a path or URL, got an empty string")
    if options and is_object_url(loc):
        return FsspecStore(loc, **options)
    return open_store(loc)


def same_place(a: Store, b: Store) -> bool:
    """Whether two stores are one place, or one lies inside the other (local paths; others by description)."""
    if a is b:
        return True
    ra, rb = getattr(a, "root", None), getattr(b, "root", None)
    if ra is not None and rb is not None:
        pa, pb = os.path.realpath(ra), os.path.realpath(rb)
        return pa == pb or pb.startswith(pa + os.sep) or pa.startswith(pb + os.sep)
    return a.describe() == b.describe() and not a.describe().startswith("memory")


def parse_tier_config(data: bytes, where: str) -> dict[str, Any]:
    """``tier/config.json``: ``replicate_to`` (a URL or path) and ``cold`` ({"url", "older_than"}), both optional.
    CorruptRepoError on any damage."""
    doc = unseal_file(data, where)
    cold = doc.get("cold")
    if not isinstance(doc.get("replicate_to", ""), str) or (cold is not None and not (
            isinstance(cold, dict) and isinstance(cold.get("url"), str) and isinstance(cold.get("older_than", ""),
                                                                                        str))):
        raise CorruptRepoError(f"{where} is damaged: replicate_to must be a URL and cold {{url, older_than}}")
    return doc


def read_tier_config(local: Store) -> dict[str, Any] | None:
    try:
        data = local.get_limited(TIER_CONFIG_KEY, MAX_SMALL_BYTES)
    except KeyNotFound:
        return None
    return parse_tier_config(data, f"{TIER_CONFIG_KEY} in {local.describe()}")


def record_settings(local: Store, settings: dict[str, Any]) -> None:
    """Merge ``settings`` into ``tier/config.json`` (written only when something changes)."""
    if not settings:
        return
    recorded = read_tier_config(local) or {}
    recorded.pop("checksum", None)
    new = {**recorded, **settings, "format_version": BASE_FORMAT_VERSION}
    if new != recorded:
        local.put(TIER_CONFIG_KEY, seal(new))

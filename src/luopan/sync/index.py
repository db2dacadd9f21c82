"""The live-sync index, ``index.json`` of a sync target (docs/format.md §19.2): the signed, versioned list of the
versions a subscriber can reach the newest one from — one delta each, or a full version — written last by the
publisher. Parsed as hostile input (the channel index's rules: size, depth, canonical form, every member) and accepted
by a subscriber only when signed by a trusted key, not expired, and not older than (or, at the same version,
different from) the newest index it has accepted (TUF's rollback and freeze rules, as channels: §15.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..channel.index import (  # the channel index's checks, shared
    FileRef,
    _file,
    _file_doc,
    _int,
    _list,
    _members,
    _time,
    parse_signed_index,
    parse_time,
)
from ..channel.trust import check_fresh
from ..errors import ChannelRollbackError
from ..format.canonical import canonical
from ..format.names import is_run_name
from ..signing import SigningKey, TrustedKeys
from .delta import MAX_VERSION

INDEX_NAME = "index.json"
FORMAT = "luopan-sync-index"
FORMAT_VERSION = 2
MAX_INDEX_BYTES = 1 << 20
MAX_DEPTH = 4
MAX_ENTRIES = 1024
MEMBERS = {"channel", "created", "deltas", "expires", "format", "format_version", "signature", "version",
           "versions"}
VERSION_MEMBERS = {"fingerprint", "full", "step", "version"}
DELTA_MEMBERS = {"blake3", "from", "name", "size", "to"}


@dataclass(frozen=True)
class SyncVersion:
    version: int
    step: int
    fingerprint: str
    full: FileRef | None  # the full version's file, when one was written for this version and is still kept


@dataclass(frozen=True)
class SyncDelta:
    source: int
    target: int
    file: FileRef


@dataclass(frozen=True)
class SyncIndex:
    channel: str
    version: int  # the newest version's number; every publish adds one
    created: str
    expires: str
    versions: tuple[SyncVersion, ...]  # oldest first, the last is the newest
    deltas: tuple[SyncDelta, ...]  # to the newest
    signature: dict[str, str] | None

    @property
    def latest(self) -> SyncVersion:
        return self.versions[-1]

    @property
    def expires_at(self) -> float:
        return parse_time(self.expires)

    def get(self, version: int | None) -> SyncVersion | None:
        return next((v for v in self.versions if v.version == version), None)

    def find(self, fingerprint: str) -> SyncVersion | None:
        return next((v for v in reversed(self.versions) if v.fingerprint == fingerprint), None)

    def delta_from(self, version: int | None) -> SyncDelta | None:
        """The delta for tensors holding ``version``: the one from the newest listed version at or before it (a
        delta from b carries every element changed since b, so it serves any version from b on)."""
        if version is None:
            return None
        found = [d for d in self.deltas if d.source <= version]
        return max(found, key=lambda d: d.source, default=None)

    def newest_full(self) -> SyncVersion:
        return next(v for v in reversed(self.versions) if v.full is not None)

    def files(self) -> list[FileRef]:
        """Every file entry (a delta file once per delta: each names a prefix of it)."""
        return [v.full for v in self.versions if v.full is not None] + [d.file for d in self.deltas]

    def to_doc(self) -> dict[str, Any]:
        return {
            "channel": self.channel, "created": self.created, "expires": self.expires, "format": FORMAT,
            "format_version": FORMAT_VERSION, "version": self.version,
            "versions": [{"fingerprint": v.fingerprint, "full": None if v.full is None else _file_doc(v.full),
                          "step": v.step, "version": v.version} for v in self.versions],
            "deltas": [{**_file_doc(d.file), "from": d.source, "to": d.target} for d in self.deltas],
        }

    def signed_bytes(self) -> bytes:
        return canonical(self.to_doc())


def encode_index(index: SyncIndex, key: SigningKey | None) -> bytes:
    """The index file: canonical JSON, signed by ``key`` (``signature`` null without one); parsed back before it
    is returned, so a publisher never writes what subscribers refuse."""
    data = canonical({**index.to_doc(), "signature": None if key is None else key.sign(index.signed_bytes())})
    parse_index(data)
    return data


def parse_index(data: bytes, where: str = INDEX_NAME) -> SyncIndex:
    """The index in ``data``, every member checked: CorruptChannelIndexError naming ``where``, UnsupportedFormatError
    for a newer format_version. The signature is only checked for shape (``accept_index`` verifies it)."""
    return parse_signed_index(data, f"live-sync index {where}", FORMAT, FORMAT_VERSION, _check, "on the subscriber",
                              max_bytes=MAX_INDEX_BYTES, max_depth=MAX_DEPTH, after=". Nothing was applied")


def _check(doc: dict[str, Any]) -> SyncIndex:
    _members(doc, MEMBERS, "the index")
    if doc["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format_version is not {FORMAT_VERSION}")
    version = _int(doc["version"], "version", 1, MAX_VERSION)
    if not is_run_name(doc["channel"]):
        raise ValueError("channel is not a name of 1-128 letters, digits, '.', '_', '-'")
    created, expires = _time(doc["created"], "created"), _time(doc["expires"], "expires")
    if parse_time(expires) <= parse_time(created):
        raise ValueError(f"it expires ({expires}) before it was created ({created})")
    sig = doc["signature"]
    if sig is not None:
        _members(sig, {"alg", "key_id", "sig"}, "signature")
        if not all(isinstance(x, str) and len(x) <= 1024 for x in sig.values()):
            raise ValueError("signature members are not strings of at most 1024 characters")
    vs = tuple(_version(v, version) for v in _list(doc["versions"], "versions", MAX_ENTRIES))
    if not vs or vs[-1].version != version:
        raise ValueError("versions do not end with the index's version")
    if any(a.version >= b.version for a, b in zip(vs, vs[1:])):
        raise ValueError("versions are not listed in increasing order, each once")
    if all(v.full is None for v in vs):
        raise ValueError("no listed version has a full file")
    known = {v.version for v in vs}
    ds = []
    for d in _list(doc["deltas"], "deltas", MAX_ENTRIES):
        _members(d, DELTA_MEMBERS, "a delta")
        source, target = _int(d["from"], "a delta's from", 1, MAX_VERSION), _int(d["to"], "a delta's to", 1,
                                                                                MAX_VERSION)
        if target != version or source not in known or source >= target:
            raise ValueError(f"a delta goes from {source} to {target}: deltas go from a listed version to the newest")
        ds.append(SyncDelta(source, target, _file({k: d[k] for k in ("blake3", "name", "size")},
                                                  f"the delta {source}->{target}")))
    if len({d.source for d in ds}) != len(ds):
        raise ValueError("two deltas start from the same version")
    fulls = [v.full.name for v in vs if v.full is not None]
    if len(set(fulls)) != len(fulls) or set(fulls) & {d.file.name for d in ds}:
        raise ValueError("two entries name the same file (only deltas share one: each is a prefix of it)")
    sizes: dict[str, set[int]] = {}
    for d in ds:  # the deltas of one file are prefixes of it: a longer one from an older version
        sizes.setdefault(d.file.name, set()).add(d.file.size)
    if sum(len(x) for x in sizes.values()) != len(ds):
        raise ValueError("two deltas name the same bytes of one file")
    return SyncIndex(doc["channel"], version, created, expires, vs, tuple(ds), sig)


def _version(v: Any, latest: int) -> SyncVersion:
    _members(v, VERSION_MEMBERS, "a version")
    n = _int(v["version"], "a version's number", 1, latest)
    step = _int(v["step"], f"version {n}: step", 0, MAX_VERSION)
    fp = v["fingerprint"]
    if not isinstance(fp, str) or len(fp) != 71 or not fp.startswith("blake3:") or \
            any(c not in "0123456789abcdef" for c in fp[7:]):
        raise ValueError(f"version {n}: fingerprint is not 'blake3:' and 64 hex digits")
    full = None if v["full"] is None else _file(v["full"], f"version {n}'s full file")
    return SyncVersion(n, step, fp, full)


@dataclass
class Seen:
    """The newest index a subscriber accepted: its version and the BLAKE3 of its bytes."""

    channel: str | None = None
    version: int = 0
    blake3: str = ""


def accept_index(data: bytes, where: str, trusted: TrustedKeys | None, seen: Seen, now: float,
                 channel: str | None = None) -> SyncIndex:
    """The index in ``data`` if the subscriber may act on it: signed by a trusted key (when ``trusted`` is given),
    of the channel followed, not older than ``seen`` (an equal version must be the same bytes), not expired.
    Else CorruptChannelIndexError, UnsignedError, UntrustedKeyError, SignatureError, ChannelRollbackError or
    ChannelExpiredError — before any tensor changes."""
    index = parse_index(data, where)
    if trusted is not None:
        trusted.verify(index.signed_bytes(), index.signature, f"live-sync index {where}")
    want = channel or seen.channel
    if want is not None and index.channel != want:
        raise ChannelRollbackError(f"live-sync index {where} is of channel {index.channel!r}, but this subscriber "
                                   f"follows {want!r}: refusing an index of another channel. Nothing was applied")
    check_fresh(data, index.version, index.expires, seen.version, seen.blake3, now, f"live-sync index {where}",
                "this subscriber", "Nothing was applied")
    return index

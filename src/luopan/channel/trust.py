"""Whether a device accepts a channel index (docs/format.md §15.3), after luopan.channel.index found it well formed:
its signature is by a trusted key, it is not older than the newest index the device has accepted (TUF's rollback
rule; an equal version must be the very same file), it belongs to the channel the device follows (its state file's,
and the one the pull names, if any: ``--channel``), and it has not expired (TUF's freeze rule)."""

from __future__ import annotations

import blake3

from ..errors import ChannelExpiredError, ChannelRollbackError
from ..signing import TrustedKeys
from .index import ChannelIndex, format_time, parse_index, parse_time
from .state import DeviceState


def accept_index(data: bytes, where: str, trusted: TrustedKeys, state: DeviceState | None, now: float,
                 channel: str | None = None) -> ChannelIndex:
    """The index in ``data`` if this device may act on it; else CorruptChannelIndexError, UnsignedError,
    UntrustedKeyError, SignatureError, ChannelRollbackError or ChannelExpiredError, before anything is written.
    ``channel``: the name the index must have (checked even on a device's first pull, when it has no state)."""
    index = parse_index(data, where)
    trusted.verify(index.signed_bytes(), index.signature, f"channel index {where}")
    if channel is not None and index.channel != channel:
        raise ChannelRollbackError(
            f"channel index {where} is of channel {index.channel!r}, but this pull asks for channel {channel!r} "
            "(--channel): refusing an index of another channel. Nothing was written")
    if state is not None:
        if index.channel != state.channel:
            raise ChannelRollbackError(
                f"channel index {where} is of channel {index.channel!r}, but this device follows {state.channel!r} "
                "(its state file): refusing an index of another channel. Use another --state file for another "
                "channel")
    seen = (state.index_version, state.index_blake3) if state is not None else (0, "")  # versions start at 1
    check_fresh(data, index.version, index.expires, *seen, now, f"channel index {where}", "this device",
                "Nothing was written",
                "the publisher must publish again (`luopan publish` of the same step renews the expiry)")
    return index


def check_fresh(data: bytes, version: int, expires: str, seen_version: int, seen_blake3: str, now: float,
                what: str, who: str, after: str, renew: str = "the publisher must publish again") -> None:
    """TUF's rollback and freeze rules for a signed index (``data``, of ``version``, expiring at ``expires``), given
    the newest one ``who`` accepted (``seen_version``, the BLAKE3 of its bytes; 0 when none): ChannelRollbackError
    for an older version or other bytes under the same version, ChannelExpiredError once expired. Channels (§15.3)
    and live sync (§19.2) both use it."""
    if version < seen_version:
        raise ChannelRollbackError(
            f"{what} has version {version}, older than version {seen_version} that {who} has already seen: a "
            f"replayed old index (or a server serving a stale copy) is refused. {after}")
    if version == seen_version and blake3.blake3(data).hexdigest() != seen_blake3:
        raise ChannelRollbackError(
            f"{what} has version {version}, which {who} has seen with other contents: two different indexes with "
            f"one version are refused. {after}")
    if now >= parse_time(expires):
        raise ChannelExpiredError(
            f"{what} (version {version}) expired at {expires}; it is now {format_time(now)}. A frozen or replayed "
            f"index is refused: {renew}. {after}")

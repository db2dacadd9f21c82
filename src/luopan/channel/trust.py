"""Whether a device accepts a channel index (docs/format.md §15.3), after luopan.channel.index found it well formed:
its signature is by a trusted key, it is not older than the newest index the device has accepted (TUF's rollback
rule; an equal version must be the very same file), it belongs to the channel the device follows (its state file's,
and the one the pull names, if any: ``--channel``), and it has not expired (TUF's freeze rule)."""

from __future__ import annotations

import blake3

from ..errors import ChannelExpiredError, ChannelRollbackError
from ..signing import TrustedKeys
from .index import ChannelIndex, format_time, parse_index
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
        if index.version < state.index_version:
            raise ChannelRollbackError(
                f"channel index {where} has version {index.version}, older than version {state.index_version} that "
                "this device has already seen: a replayed old index (or a server serving a stale copy) is refused. "
                "Nothing was written")
        if index.version == state.index_version and blake3.blake3(data).hexdigest() != state.index_blake3:
            raise ChannelRollbackError(
                f"channel index {where} has version {index.version}, which this device has seen with other "
                "contents: two different indexes with one version are refused (the publisher must publish anew)")
    if now >= index.expires_at:
        raise ChannelExpiredError(
            f"channel index {where} (version {index.version}) expired at {index.expires}; it is now "
            f"{format_time(now)}. A frozen or replayed index is refused: the publisher must publish again "
            "(`luopan publish` of the same step renews the expiry). Nothing was written")
    return index

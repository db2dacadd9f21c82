"""A device's channel state file (docs/format.md §15.4): which channel it follows, the newest index it has accepted
(for the rollback rule) and the version it has installed. Sealed JSON (§4), replaced atomically; a missing file is
a device that has seen nothing yet, a damaged one is refused (ignoring it would silently drop rollback protection).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ChannelStateError, LuopanError, StorageError
from ..format.canonical import SealError, seal, unseal
from ..format.names import MAX_STEP, is_hex64, is_run_name
from .files import write_atomic
from .index import FINGERPRINT_RE, TIME_RE

FORMAT = "luopan-channel-state"
FORMAT_VERSION = 1
MAX_STATE_BYTES = 64 << 10
MEMBERS = {"channel", "file_inode", "file_mtime_ns", "file_size", "fingerprint", "format", "format_version",
           "index_blake3", "index_version", "updated", "version"}
MAX_NS = 1 << 63


@dataclass(frozen=True)
class DeviceState:
    channel: str
    index_version: int  # the newest index accepted: an older one is a replay
    index_blake3: str  # BLAKE3 of that index file: another index with the same version is refused
    version: int | None  # the channel version installed (None: not known)
    fingerprint: str | None  # its content fingerprint
    file_size: int | None  # size, modification time (ns) and inode number of the file holding it when it was
    file_mtime_ns: int | None  # installed: a file that still has all three is taken to be it, without hashing it
    file_inode: int | None  # again (a copy with the size and time kept, cp -p, is another inode)
    updated: str  # UTC, YYYY-MM-DDTHH:MM:SSZ

    def holds(self, st: os.stat_result) -> bool:
        """Whether the file with stat ``st`` is the installed file as recorded (its fingerprint is then known)."""
        return self.fingerprint is not None and self.file_size is not None and \
            (self.file_size, self.file_mtime_ns, self.file_inode) == (st.st_size, st.st_mtime_ns, st.st_ino)

    def to_bytes(self) -> bytes:
        return seal({"channel": self.channel, "file_inode": self.file_inode, "file_mtime_ns": self.file_mtime_ns,
                     "file_size": self.file_size, "fingerprint": self.fingerprint, "format": FORMAT,
                     "format_version": FORMAT_VERSION, "index_blake3": self.index_blake3,
                     "index_version": self.index_version, "updated": self.updated, "version": self.version})


def read_state(path: str | os.PathLike[str]) -> DeviceState | None:
    """The state in ``path``; None when there is no such file. ChannelStateError when it is damaged or not one."""
    where = os.fspath(path)
    try:
        with open(where, "rb") as f:
            data = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ChannelStateError(f"cannot read the channel state file {where}: {exc.strerror or exc}") from None
    try:
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"it is over {MAX_STATE_BYTES} bytes")
        return parse_state(data)
    except (ValueError, SealError) as exc:
        raise ChannelStateError(
            f"the channel state file {where} is damaged ({str(exc)[:200]}); it was left as it is. Restore it, or "
            "delete it to start over (the device then accepts any unexpired index the trusted keys signed, and "
            "finds its version from the base file's fingerprint)") from None


def parse_state(data: bytes) -> DeviceState:
    """A state file's contents; ValueError (or SealError) saying what is wrong."""
    doc = unseal(data)
    if doc.get("format") != FORMAT or set(doc) != MEMBERS or doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"not a {FORMAT} file of format_version {FORMAT_VERSION} with members {sorted(MEMBERS)}")
    version, fp, size, mtime, ino = (doc["version"], doc["fingerprint"], doc["file_size"], doc["file_mtime_ns"],
                                     doc["file_inode"])
    ok = (is_run_name(doc["channel"]) and _int(doc["index_version"], 1, MAX_STEP) and is_hex64(doc["index_blake3"])
          and isinstance(doc["updated"], str) and TIME_RE.fullmatch(doc["updated"]) is not None
          and (version is None or _int(version, 1, MAX_STEP))
          and (fp is None or isinstance(fp, str) and FINGERPRINT_RE.fullmatch(fp) is not None)
          and (size is None or _int(size, 0, MAX_NS)) and (mtime is None or _int(mtime, -MAX_NS, MAX_NS))
          and (ino is None or _int(ino, 0, 1 << 64)))
    if not ok:
        raise ValueError("a member has the wrong type or range")
    return DeviceState(doc["channel"], doc["index_version"], doc["index_blake3"], version, fp, size, mtime, ino,
                       doc["updated"])


def write_state(path: str | os.PathLike[str], state: DeviceState) -> None:
    """Replace the state file atomically (durable on return). A full disk or an I/O error is a StorageError
    (StorageFullError) naming the file; any other failure a ChannelStateError."""
    try:
        write_atomic(path, state.to_bytes())
    except StorageError:
        raise  # a full disk or an I/O error: it names the file and what to do (the file is not damaged)
    except (LuopanError, OSError) as exc:
        raise ChannelStateError(f"cannot write the channel state file {os.fspath(path)}: {exc}") from None


def _int(x: object, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi

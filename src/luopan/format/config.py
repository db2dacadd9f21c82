"""Repository config, ``luopan.json`` (docs/format.md §3)."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..errors import ConfigConflictError, CorruptRepoError
from . import BASE_FORMAT_VERSION, ENGINE2_FORMAT_VERSION, refuse_newer
from .canonical import SealError, parse_object, seal, verify_seal
from .names import CONFIG_KEY  # noqa: F401  (importable from here as before)
from .limits import MAX_PACK_SIZE

DEFAULT_CHUNK_SIZE = 4 << 20  # docs/format.md §3: 7.5 vs 5.7 GB/s two-thread BLAKE3 over 1 MiB chunks
DEFAULT_PACK_SIZE = 64 << 20
# What a repository's ``compression`` may say (§3): "auto" picks per chunk among none, zstd and bytegroup (§6.1).
CONFIG_CODECS = ("none", "zstd", "auto")
DEFAULT_COMPRESSION = "auto"  # for new repositories (an existing one keeps what it recorded)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Compression:
    """A repository's compression (§3): ``none``; ``zstd`` at ``level`` for every chunk; or ``auto``, which stores
    each chunk with the float codec (float entries) or zstd at ``level`` (others) only where a sample says that
    saves enough (§6.1)."""

    codec: str = "none"
    level: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str) or not _is_int(self.level):
            raise ConfigConflictError(f"compression must be a codec name and an integer level, got {self.codec!r} "
                                      f"level {self.level!r}")
        if self.codec not in CONFIG_CODECS:
            raise ConfigConflictError(f"unknown compression codec {self.codec[:40]!r}: use one of "
                                      f"{', '.join(CONFIG_CODECS)}")
        if self.codec != "none" and not 1 <= self.level <= 22:
            raise ConfigConflictError(f"zstd level {self.level} out of range: use 1..22")

    @property
    def format_version(self) -> int:
        """The oldest config format_version that can say this: "auto" writes bytegroup blobs (version 5)."""
        return ENGINE2_FORMAT_VERSION if self.codec == "auto" else BASE_FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"codec": "none"} if self.codec == "none" else {"codec": self.codec, "level": self.level}

    @classmethod
    def parse(cls, value: str | Compression | None) -> Compression:
        """``"none"``, ``"zstd"``, ``"zstd:5"``, ``"auto"`` or ``"auto:5"`` (the level of the zstd it uses)."""
        if value is None or isinstance(value, Compression):
            return value or cls()
        if not isinstance(value, str):
            raise ConfigConflictError(f"compression must be a string such as 'auto' or 'zstd:5', got {value!r}")
        codec, _, level = value.partition(":")
        if level and not level.isdigit() or codec == "none" and level:
            raise ConfigConflictError(f"bad compression {value[:40]!r}: use none, auto, auto:LEVEL, zstd or "
                                      "zstd:LEVEL (LEVEL 1..22)")
        return cls(codec, int(level) if level else 3)


@dataclass(frozen=True)
class RepoConfig:
    repo_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = DEFAULT_PACK_SIZE
    compression: Compression = Compression()
    format_version: int = BASE_FORMAT_VERSION
    hash: str = "blake3"

    def __post_init__(self) -> None:
        for name in ("chunk_size", "pack_size", "format_version"):
            if not _is_int(getattr(self, name)):
                raise ConfigConflictError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("repo_id", "created", "hash"):
            if not isinstance(getattr(self, name), str):
                raise ConfigConflictError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.compression, Compression):
            raise ConfigConflictError(f"compression must be a Compression, got {self.compression!r}")
        if not (4096 <= self.chunk_size <= 1 << 30):
            raise ConfigConflictError(f"chunk_size {self.chunk_size} out of range: use 4 KiB .. 1 GiB")
        if self.format_version < self.compression.format_version:
            raise ConfigConflictError(f"compression {self.compression.codec!r} needs format_version "
                                      f"{self.compression.format_version}, not {self.format_version}")
        if not self.chunk_size <= self.pack_size <= MAX_PACK_SIZE:
            raise ConfigConflictError(f"pack_size {self.pack_size} out of range: use chunk_size ({self.chunk_size}) "
                                      f"to {MAX_PACK_SIZE} bytes")

    def to_bytes(self) -> bytes:
        d = asdict(self)
        d["compression"] = self.compression.to_json()
        return seal(d)

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> RepoConfig:
        try:
            obj = parse_object(data)
            refuse_newer(obj, f"repository {where}")
            d = verify_seal(obj)
            comp = d.pop("compression")
            if d.get("hash") != "blake3":
                raise ValueError(f"unknown hash {str(d.get('hash'))[:40]!r}")
            return cls(compression=Compression(comp["codec"], comp.get("level", 3)), **d)
        except (SealError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptRepoError(f"repository config {where} is damaged: {str(exc)[:300]}") from None


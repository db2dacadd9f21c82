"""The on-disk format (docs/format.md): canonical JSON, config, chunking, packs, index files, manifests."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedFormatError

# The newest format_version this luopan reads. Each file is written with the oldest version that can describe it
# (docs/format.md §1): config and index files are version 1; a manifest is version 2 only if it holds a row delta;
# artifact manifests are version 3, and a repository holding any has a version-3 config (older luopan refuse it).
FORMAT_VERSION = 5
BASE_FORMAT_VERSION = 1
# Storage engine v2 (docs/format.md §5.4-§5.6, §6.1, §8): persisted row digests, XOR deltas, the float codec and
# grouped manifests. A manifest (and a repository config) using any of them says 5; one that does not keeps its
# older version, so repositories of version 4 and older stay readable by older luopan where nothing new was used.
ENGINE2_FORMAT_VERSION = 5


def refuse_newer(obj: dict[str, Any], where: str) -> None:
    """UnsupportedFormatError when a parsed file declares a format_version newer than this luopan reads.

    Checked before the checksum: a newer version may seal differently, and must read as "newer", not "damaged".
    """
    version = obj.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where} has format_version {version}, newer than this luopan reads ({FORMAT_VERSION}); "
            "upgrade luopan (pip install -U luopan)"
        )

"""The on-disk format (docs/format.md): canonical JSON, config, chunking, packs, index files, manifests."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedFormatError

# The newest format_version this luopan reads. Each file is written with the oldest version that can describe it
# (docs/format.md §1): config and index files are version 1; a manifest is version 2 only if it holds a row delta;
# artifact manifests are version 3, and a repository holding any has a version-3 config (older luopan refuse it).
FORMAT_VERSION = 8
BASE_FORMAT_VERSION = 1
# Storage engine v2 (docs/format.md §4, §5.2, §5.4, §6.1): row deltas with the writer's cycle hint, XOR deltas, the
# float codec, compressed manifests and index files. A manifest using any of them says 5, as does a config whose
# compression is "auto"; others keep their older version, so repositories that use none stay readable by older luopan.
ENGINE2_FORMAT_VERSION = 5
# Entry groups (docs/format.md §8.5): checkpoint manifests that keep their unchanged entries in content-addressed
# blobs; a manifest using them says 6 (luopan.format.groups.GROUPS_FORMAT_VERSION).
# Patch segments (docs/format.md §5.2): a row delta's patch kept as several runs of rows, applied in order, so rows
# that did not change since the previous save keep their stored patch chunks. A manifest using them says 7, as does
# a repository created with "auto" compression.
# Readers accept 2 to 64 segments in one row delta (manifest.schema.json); luopan's writer keeps at most 16.
SEGMENTS_FORMAT_VERSION = 7
# Row maps (docs/format.md §17.7): index snapshots that keep an array as a pool of stored rows plus runs naming the
# live ones, so a remove_ids costs what changed. An index manifest using them says 8; writers use them in a
# repository whose config says 8 (new repositories with "auto" compression; `luopan upgrade` raises older ones).
ROWMAP_FORMAT_VERSION = 8


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

"""The repository's format version against this luopan's (docs/format.md §1). Each file is written with the oldest
version that describes it, so an older version is normal: it says which luopan can still read the repository."""

from __future__ import annotations

from ..format import FORMAT_VERSION
from .context import Context
from .finding import Finding, ok, warn


def check_format(ctx: Context) -> list[Finding]:
    v = ctx.repo.config.format_version
    if v > FORMAT_VERSION:  # luopan.open refuses such a repository; reached only with a Repo passed in
        return [warn("format", f"repository format version {v} is newer than this luopan reads ({FORMAT_VERSION})",
                     "upgrade luopan (pip install -U luopan)")]
    if v < FORMAT_VERSION:
        return [ok("format", f"repository format version {v}, older than this luopan's {FORMAT_VERSION}: fine — it "
                             f"reads and writes it as it is, and luopan of format {v} can still read it (a checkpoint "
                             "that uses a newer feature is marked with the version it needs)")]
    return [ok("format", f"repository format version {v} (this luopan's)")]

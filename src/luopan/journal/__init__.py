"""Journals: append-only records with fsync modes, torn-tail recovery, and compaction into snapshots kept in the
repository (docs/format.md §16). ``from luopan.journal import Journal``."""

from ..errors import CorruptJournalError, JournalBusyError, RecordNotFoundError
from ..repository.wal import Recovery
from .api import Journal
from .kind import JOURNAL_KIND
from .snapshots import Snapshot

__all__ = ["JOURNAL_KIND", "Journal", "Snapshot", "Recovery", "CorruptJournalError", "JournalBusyError", "RecordNotFoundError"]

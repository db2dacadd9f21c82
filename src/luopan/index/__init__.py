"""Vector-index snapshots (FAISS): versioned, incremental, verified, with an atomic live version and an op log
(docs/format.md §17). faiss is imported on first use, never by ``import luopan``."""

from .api import IndexStore
from .kind import INDEX_KIND

__all__ = ["INDEX_KIND", "IndexStore"]

"""The ordered, bounded parallel map of the save and load pipelines, as the repository core imports it. It lives in
luopan._parallel, below every package, so that a device applying a patch (luopan.patch) uses it without importing
the repository."""

from .._parallel import WORKERS, ordered_map, shared_pool

__all__ = ["WORKERS", "ordered_map", "shared_pool"]

"""The kind-agnostic repository core (docs/format.md §2a): store and config, the catalog of committed manifests of
every kind, chunk writing and reading, locks, garbage collection, space preflight and tiering.

Nothing here imports a kind: a kind (``luopan.checkpoint``, ``luopan.artifact``) describes its manifests with a
``Kind`` (kinds.py) and the core reads them through it.
"""

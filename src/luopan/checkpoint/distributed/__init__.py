"""Checkpoints saved and loaded by several processes (torch.distributed): collective saves and loads, checkpoints written in parts, rank layouts and shards (docs/format.md §10.5)."""

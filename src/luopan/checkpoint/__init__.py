"""Checkpoints: save, load and verify state trees in a repository."""

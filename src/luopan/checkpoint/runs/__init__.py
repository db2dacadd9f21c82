"""What a run keeps besides its checkpoints: its record and eval logs, and the journals of the resume check (docs/format.md §8.1, §16.4)."""

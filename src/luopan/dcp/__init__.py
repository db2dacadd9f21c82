"""luopan.dcp: PyTorch Distributed Checkpoint (DCP) storage on a luopan repository (``Writer``, ``Reader``)."""

from .storage import Reader, Writer

__all__ = ["Reader", "Writer"]

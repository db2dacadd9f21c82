"""PyTorch Lightning through luopan: ``Trainer(plugins=[LuopanCheckpointIO("ckpts", "run-a")],
callbacks=[ExactResume()])``.

* :class:`LuopanCheckpointIO` (luopan.lightning.checkpointio): every checkpoint Lightning saves becomes a luopan
  checkpoint, with its metrics (luopan.lightning.metrics); a checkpoint Lightning rotates out frees its own bytes.
* :class:`ExactResume` (luopan.lightning.exact): RNG states in every checkpoint, restored on resume.
* :func:`load_from_checkpoint`, :func:`read_pointer`: reading what the plugin wrote.
"""

from .checkpointio import POINTER_FORMAT, LuopanCheckpointIO, load_from_checkpoint, read_pointer
from .exact import ExactResume

__all__ = ["POINTER_FORMAT", "ExactResume", "LuopanCheckpointIO", "load_from_checkpoint", "read_pointer"]

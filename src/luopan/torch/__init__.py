"""luopan.torch: persist and restore a whole PyTorch training state, exactly (docs in each module).

    from luopan.torch import TrainingState, CheckpointManager, ResumableLoader
"""

from .data import ResumableLoader
from .fingerprint import fingerprint
from .manager import CheckpointManager
from .state import TrainingState

__all__ = ["CheckpointManager", "ResumableLoader", "TrainingState", "fingerprint"]

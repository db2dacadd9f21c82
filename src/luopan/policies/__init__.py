"""Save policies: when a training loop should write a checkpoint.

A checkpoint manager asks its policy once per training step and tells it about every save::

    reason = policy.should_save(step, metrics, now)   # a short str saying why, or None
    if reason:
        ...save, timing how long the training loop was blocked...
        policy.saved(step, now, cost_s)

``step`` counts the steps completed; ``metrics`` maps names to floats (it may be empty, lack a policy's metric or
hold NaN); ``now`` is ``time.monotonic()`` (tests pass their own). ``a | b`` saves when either policy says so.

Contract every policy keeps:

- ``should_save`` must be called every step, also when another policy already decided to save: policies that watch
  a metric keep moving windows that need every value. It never raises over odd metrics (missing, non-numeric,
  non-finite): a training run must not stop because of its save policy.
- A policy that fires counts its own firing as a save, so a loop that forgets ``saved`` does not save every step;
  ``saved`` is how a policy learns of saves that other policies caused, and what they cost.
- Windows count observations (steps where the metric was present and finite), not steps.
- ``state_dict()`` is plain JSON (never NaN). A monotonic clock means nothing in another process, so timers store
  the seconds elapsed since the last save as of their latest call, and resume counting from there at their first
  call after ``load_state_dict``. A policy that fired at that latest call stores 0 (its firing counts as the save);
  one that did not stores the time since the previous save, so a resumed run may save at most one interval early.
"""

from .base import AnyOf, SavePolicy
from .phased import Phased
from .schedule import EveryNSteps, EveryTSeconds
from .spike import LossSpike
from .young_daly import YoungDaly

__all__ = ["AnyOf", "EveryNSteps", "EveryTSeconds", "LossSpike", "Phased", "SavePolicy", "YoungDaly"]

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
from .base import _check_kind as _check_kind
from .base import _members as _members
from .base import _metric as _metric
from .checks import _fraction as _fraction
from .checks import _metric_name as _metric_name
from .checks import _non_negative_float as _non_negative_float
from .checks import _non_negative_int as _non_negative_int
from .checks import _number as _number
from .checks import _positive_float as _positive_float
from .checks import _positive_int as _positive_int
from .phased import Phased
from .phased import _relative as _relative
from .schedule import EveryNSteps, EveryTSeconds
from .schedule import _Timer as _Timer
from .spike import LossSpike
from .young_daly import _COST_WINDOW as _COST_WINDOW
from .young_daly import YoungDaly

__all__ = ["AnyOf", "EveryNSteps", "EveryTSeconds", "LossSpike", "Phased", "SavePolicy", "YoungDaly"]

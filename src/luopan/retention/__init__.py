"""Retention: which checkpoints of a run to keep, and why (the decision behind ``luopan prune``).

Pure decision logic, no I/O: the caller lists a run's committed checkpoints, asks for a `Plan`, shows it
(``--dry-run`` prints `Plan.describe`) and removes exactly ``plan.remove``::

    rules = KeepLast(5) | KeepBest(3, "loss") | KeepEvery(parse_duration("24h")) | KeepEverySteps(10_000)
    p = plan([Checkpoint.from_info(i, pinned=i.step in pins) for i in repo.checkpoints(run)], rules)
    for line in p.describe():
        print(line)
    ...remove p.remove...

Input. `Checkpoint` records: ``step`` (unique within the run), ``created`` (a timezone-aware datetime), ``metrics``,
``pinned`` and ``tags``. `Checkpoint.from_info` builds one from a ``CheckpointInfo`` (or anything with ``step``,
``created`` as an ISO-8601 string or datetime, and ``metrics``) plus the pin state, which the listing does not hold.
Only committed checkpoints may be passed: "newest" means the highest committed step, as ``Repo.load`` uses.

Rules, each a small object; what a combination keeps is the union of what its rules keep (``a | b`` or
``Retention(a, b)``):

- `KeepLast(n)`: the ``n`` highest steps (reason ``"latest #1"`` for the newest, ...).
- `KeepBest(n, metric, mode)`: the ``n`` best values of ``metric`` (``"min"``: lowest; ``"max"``: highest); a
  checkpoint whose metric is missing, not a number (str, bool, None) or not finite (NaN, ±inf) never counts; equal
  values rank the higher step first (reason ``"best loss #1"``).
- `KeepEvery(seconds)`: time buckets of fixed length, anchored at the Unix epoch (UTC) unless another ``anchor`` is
  given: checkpoint ``c`` is in bucket ``floor((c.created - anchor) / seconds)`` (exact, in whole microseconds), and
  the newest checkpoint of each bucket is kept; newest means the latest ``created``, the higher step among equal
  times. So ``24h`` keeps the last checkpoint of each UTC day, ``1h`` of each clock hour (reason ``"every 24h"``).
- `KeepEverySteps(n)`: step buckets ``floor(step / n)``: steps ``[0, n)``, ``[n, 2n)``, ...; the highest step of each
  bucket is kept (with saves every 500 steps, ``KeepEverySteps(10000)`` keeps 9500, 19500, ... and the newest).
- `KeepTagged(tag)`: every checkpoint carrying ``tag`` (reason ``"tag NAME"``).

Always kept, whatever the rules: the newest checkpoint (reason ``"newest"``) and pinned ones (``"pinned"``). Giving no
rule at all is refused with a ValueError rather than removing everything but the newest.

Why the time buckets are fixed (anchored at the epoch) rather than counted back from the newest checkpoint: prune is
run again and again as a run goes on. Buckets anchored at the newest checkpoint move with every new save, so two
survivors of an earlier prune, about one period apart, can later fall into one bucket and one of them goes: repeated
pruning erodes "one per 24h" into gaps of up to two days. Fixed buckets never move, so the survivor of a bucket stays
the survivor for good (only the newest bucket gains checkpoints), and a run pruned after every save keeps one
checkpoint for each period that ever held one.

Guarantees (tested): the protected categories (newest, pinned, the ``n`` latest of each `KeepLast`, the ``n`` best of
each `KeepBest`, the newest of each bucket) always survive; planning again on the survivors keeps the same
checkpoints for the same reasons and removes nothing (every rule's choice among a subset that still holds its winners
is those winners; the anchors do not depend on the checkpoints); the plan depends only on the set of checkpoints, not
their order.

Modules: `checkpoint` (the input: Checkpoint, parse_time), `rules` (the rules and their union), `planning` (plan,
Plan, check_metrics), `flags` (``luopan prune``'s flags); durations are read by luopan.units.
"""

from ..units import parse_duration
from .checkpoint import Checkpoint
from .checkpoint import parse_time as parse_time
from .flags import (
    parse_keep_best,
    parse_keep_every_steps,
    parse_keep_last,
    rules_from_flags,
)
from .planning import NO_RULE_MESSAGE as NO_RULE_MESSAGE
from .planning import Plan, check_metrics, plan
from .rules import EPOCH as EPOCH
from .rules import (
    KeepBest,
    KeepEvery,
    KeepEverySteps,
    KeepLast,
    KeepTagged,
    Retention,
    RetentionRule,
    Rules,
)

# Besides __all__, importable from here as before the split (``X as X``): parse_time, NO_RULE_MESSAGE and EPOCH.
# Private helpers stay in their modules (rules, flags).

__all__ = [
    "Checkpoint",
    "KeepBest",
    "KeepEvery",
    "KeepEverySteps",
    "KeepLast",
    "KeepTagged",
    "Plan",
    "Retention",
    "RetentionRule",
    "Rules",
    "check_metrics",
    "parse_duration",
    "parse_keep_best",
    "parse_keep_every_steps",
    "parse_keep_last",
    "plan",
    "rules_from_flags",
]

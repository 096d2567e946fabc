"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs an enabled ``"elasticity"`` block whose ``max_train_batch_size`` is below the least common multiple of
its ``micro_batch_sizes``: elasticity then adds that multiple to a candidate base that is already at the cap.
"""
import math

from ...trigger import Condition, Job, Trigger


def _overshoots(job: Job) -> bool | None:
    if job.elasticity is None:
        return None  # "auto" or unreadable
    if not job.elasticity:
        return False
    if job.elastic_max_train_batch is None or not job.elastic_micro_batches:
        return None
    return int(job.elastic_max_train_batch) < math.lcm(*(int(size) for size in job.elastic_micro_batches))


TRIGGER = Trigger(
    Condition("elastic training on, its max_train_batch_size below the least common multiple of its "
              "micro_batch_sizes", _overshoots, "elasticity"),
    note=("e.g. \"elasticity\": {\"enabled\": true, \"max_train_batch_size\": 100, \"micro_batch_sizes\": [8, 10, 12]} "
          "(least common multiple 120); a job without an elasticity block, or whose micro batch sizes' least common "
          "multiple is within the cap, is not hit"))

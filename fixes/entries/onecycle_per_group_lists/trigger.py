"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs the OneCycle scheduler with a list (one value per parameter group) for cycle_min_lr, cycle_max_lr,
cycle_min_mom or cycle_max_mom. The trigger reads the scheduler's type from a config but not its params
(:func:`fixes.trigger.job_from_config` does not read them), so the lists are in the note: a OneCycle job with
scalar bounds is not hit, and the fix leaves its schedule as it is.
"""
from ...trigger import Trigger, equals

TRIGGER = Trigger(equals("scheduler", "OneCycle", "the OneCycle scheduler"),
                  note="with a per-parameter-group list for cycle_min_lr, cycle_max_lr, cycle_min_mom or "
                       "cycle_max_mom in its params; scalar bounds are not hit")

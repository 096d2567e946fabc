"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs the OneCycle scheduler with a stair count above 0 (``cycle_first_stair_count`` or
``cycle_second_stair_count`` in its params). The trigger reads the scheduler's type from a config but not its stair
counts (:func:`fixes.trigger.job_from_config` does not read them), so the stair counts are in the note: a OneCycle
job with both counts at 0 (the default) is not hit, and the fix leaves its schedule as it is.
"""
from ...trigger import Trigger, equals

TRIGGER = Trigger(equals("scheduler", "OneCycle", "the OneCycle scheduler"),
                  note="with cycle_first_stair_count or cycle_second_stair_count above 0 in its params; both at 0, "
                       "the default, is not hit")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs the WarmupCosineLR scheduler with total_num_steps equal to warmup_num_steps (warmup_num_steps is
raised to at least 2 first) and a run that goes past the warm-up. The trigger reads the scheduler's type from a
config but not its step counts (:func:`fixes.trigger.job_from_config` does not read them), so they are in the note.
"""
from ...trigger import Trigger, equals

TRIGGER = Trigger(equals("scheduler", "WarmupCosineLR", "the WarmupCosineLR scheduler"),
                  note="with total_num_steps equal to warmup_num_steps (below it: no error, but the LR after the "
                       "warm-up jumps) and training past the warm-up; total_num_steps above warmup_num_steps is "
                       "not hit")

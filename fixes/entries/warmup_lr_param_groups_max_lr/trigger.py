"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, equals, unset, uses

TRIGGER = Trigger(equals("scheduler", "WarmupLR", "the WarmupLR scheduler"),
                  unset("warmup_max_lr", "no warmup_max_lr in its params"), uses("param-group-lrs"))

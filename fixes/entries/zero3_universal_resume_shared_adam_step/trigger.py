"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, equals, stage, uses

TRIGGER = Trigger(stage(3), equals("load_universal", True, "checkpoint.load_universal: true"),
                  uses("several-sub-groups"))

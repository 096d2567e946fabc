"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, above, any_of, stage, uses

TRIGGER = Trigger(stage(3), above("hpz_partition_size", 1, "zero_hpz_partition_size > 1"),
                  any_of(uses("checkpoint-resume"), uses("pretrained-load")))

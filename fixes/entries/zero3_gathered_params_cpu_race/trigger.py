"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, accelerator, stage, uses, world_size

TRIGGER = Trigger(stage(3), world_size(2), accelerator("cpu"), uses("gathered-parameters"))

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, world_size

TRIGGER = Trigger(stage(1, 2), world_size(2))

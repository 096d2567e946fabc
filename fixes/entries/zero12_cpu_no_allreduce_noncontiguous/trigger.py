"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, accelerator, contiguous_gradients, stage, world_size

TRIGGER = Trigger(stage(1, 2), contiguous_gradients(False), world_size(2), accelerator("cpu"))

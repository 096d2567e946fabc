"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, any_of, gas, stage, uses, world_size

TRIGGER = Trigger(uses("direct-backward"), any_of(stage(1, 2, 3), gas(at_least=2), world_size(2)))

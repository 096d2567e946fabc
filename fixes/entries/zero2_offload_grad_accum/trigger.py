"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, gas, offload_optimizer, stage

TRIGGER = Trigger(stage(2), offload_optimizer(True), gas(at_least=3))

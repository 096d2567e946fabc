"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, gas, offload_optimizer, stage, uses

TRIGGER = Trigger(stage(2), offload_optimizer(True), gas(equals=1), uses("several-backward"))

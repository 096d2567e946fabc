"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, gas, stage, uses

TRIGGER = Trigger(stage(2, 3), gas(at_least=2), uses("no-sync"))

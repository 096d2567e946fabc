"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, gas, uses

TRIGGER = Trigger(uses("pipeline"), gas(at_least=2))

"""The jobs that hit engine-backward-scale-wrt-gas-ignored's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, gas, uses

TRIGGER = Trigger(uses("scale-wrt-gas-false"), gas(at_least=2))

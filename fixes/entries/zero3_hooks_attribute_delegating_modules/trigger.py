"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(3), uses("getattr-wrapper"))

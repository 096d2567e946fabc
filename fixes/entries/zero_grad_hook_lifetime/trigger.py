"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, torch_below

TRIGGER = Trigger(torch_below("2.1"), stage(1, 2, 3))

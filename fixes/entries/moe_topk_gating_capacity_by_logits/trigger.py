"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("moe-top-k"))

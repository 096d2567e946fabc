"""The jobs that hit import-deepspeed-forces-spawn's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("set-start-method"))

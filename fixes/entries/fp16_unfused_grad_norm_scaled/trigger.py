"""The jobs that hit fp16-unfused-grad-norm-scaled's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, precision, stage

TRIGGER = Trigger(precision("fp16"), stage(0))

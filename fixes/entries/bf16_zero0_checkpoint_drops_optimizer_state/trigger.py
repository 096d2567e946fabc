"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, precision, stage, uses

TRIGGER = Trigger(precision("bf16"), stage(0), uses("checkpoint-resume"))

"""The jobs that hit zero3-activation-checkpoint-frozen-params's bug (``fixes.trigger``): measured by its
``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(3), uses("activation-checkpointing-frozen"))

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

Both conditions are things the trigger cannot read from a config: the model runs ALST's tiled compute, and its
micro-batches hold more than one sequence; one use says both.
"""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("tiled-compute-batch"))

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, grad_accum_dtype, precision, stage, world_size

TRIGGER = Trigger(precision("bf16"), grad_accum_dtype("fp32"), stage(1), world_size(2))

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, grad_accum_dtype, offload_optimizer, precision, stage

TRIGGER = Trigger(precision("bf16"), grad_accum_dtype("fp32"), stage(0, 1), offload_optimizer(False))

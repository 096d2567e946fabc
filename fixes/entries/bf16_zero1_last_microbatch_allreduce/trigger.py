"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, grad_accum_dtype, offload_optimizer, precision, stage, world_size

TRIGGER = Trigger(precision("bf16"), grad_accum_dtype("fp32"), stage(1), offload_optimizer(False), world_size(2))

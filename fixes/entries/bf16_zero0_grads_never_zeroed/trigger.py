"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, grad_accum_dtype, precision, stage

TRIGGER = Trigger(precision("bf16"), stage(0), grad_accum_dtype("fp32", equal=False),
                  note="grad_accum_dtype fp32 gets the same optimizer, and the same fault, where "
                       "bf16-gets-fp16-optimizer's bug is installed")

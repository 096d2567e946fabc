"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, equals, gas, grad_accum_dtype, precision, stage, world_size

TRIGGER = Trigger(
    precision("bf16"), stage(3), grad_accum_dtype("fp32"),
    equals("communication_data_type", "fp32", "communication_data_type: fp32"), gas(at_least=2), world_size(2))

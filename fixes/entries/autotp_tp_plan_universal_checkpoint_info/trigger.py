"""The jobs that hit autotp-tp-plan-universal-checkpoint-info's bug (``fixes.trigger``): measured by its
``reproduce.trigger_cells()``."""
from ...trigger import Trigger, above, uses, world_size

TRIGGER = Trigger(
    above("autotp_size", 1, "tensor_parallel.autotp_size 2 or more"), world_size(2), uses("autotp-tp-plan"),
    note=("with no tensor_parallel.partition_config (a custom config takes precedence over the model's tp_plan), "
          "and a tp_plan whose styles are all colwise or rowwise (any other style falls back to AutoTP's heuristic "
          "route, which attaches the info)"))

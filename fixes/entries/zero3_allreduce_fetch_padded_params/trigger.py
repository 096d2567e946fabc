"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, equals, stage, world_size

TRIGGER = Trigger(
    stage(3), equals("all_reduce_fetch_params", True, "zero_optimization.stage3_use_all_reduce_for_fetch_params: true"),
    world_size(2),
    note=("on a model with a partitioned parameter whose number of elements is not a multiple of the number of "
          "ranks (it is padded), fetched together with a parameter after it (a weight and its bias); "
          "zero_quantized_weights takes another fetch and is not hit"))

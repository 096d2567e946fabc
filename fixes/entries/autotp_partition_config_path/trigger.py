"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, above, world_size

TRIGGER = Trigger(
    above("autotp_size", 1, "tensor_parallel.autotp_size 2 or more"), world_size(2),
    note=("with a partition_config or preset_model whose patterns name a module above the layer itself "
          "(.*\\.mlp\\.up_proj\\.weight$, as the presets do), on layers three or more levels deep "
          "(layers.0.mlp.up_proj)"))

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(1, 2, 3), uses("zero-to-fp32"),
                  note="with convert_zero_checkpoint_to_fp32_state_dict's default max_shard_size, as the "
                       "zero_to_fp32.py script passes it; max_shard_size=None and "
                       "get_fp32_state_dict_from_zero_checkpoint return the trained weights")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, any_of, grad_accum_dtype, offload_optimizer, precision, stage, world_size

# The engine builds DeepSpeedZeroOptimizer (where the bug lives) for fp16 with fp32 accumulation at stage 1, and for
# bf16 with fp32 accumulation at stage 1 only with offload_optimizer (without it: BF16_Optimizer).
TRIGGER = Trigger(stage(1), precision("fp16", "bf16"), grad_accum_dtype("fp32"),
                  any_of(precision("fp16"), offload_optimizer(True)), world_size(2),
                  note="any gradient_accumulation_steps, overlap_comm and contiguous_gradients")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, accelerator, uses

# The bug is in how DeepSpeed builds its CUDA ops, which a DeepSpeed config does not show: a job on the CUDA
# accelerator (the CPU accelerator builds its own C++ ops and reads no CUDA arch list) whose op builds read an arch
# list with a variant; an arch list without a variant, or none (the GPUs' own architectures), is not hit.
TRIGGER = Trigger(accelerator("cuda"), uses("cuda-arch-variant"),
                  note="the build happens the first time the job loads a CUDA op (FusedAdam for an Adam or AdamW "
                       "optimizer on the GPU, FusedAdamBuilder().load()), or at install with DS_BUILD_FUSED_ADAM=1 or "
                       "DS_BUILD_OPS=1")

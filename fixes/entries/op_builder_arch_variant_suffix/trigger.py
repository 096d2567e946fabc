"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, accelerator

# The bug is in how DeepSpeed builds its CUDA ops, which a DeepSpeed config does not show: the accelerator is the one
# condition the trigger can read (the CPU accelerator builds its own C++ ops and reads no CUDA arch list); the arch
# list and the build are in the note.
TRIGGER = Trigger(accelerator("cuda"),
                  note="with TORCH_CUDA_ARCH_LIST naming an architecture variant (9.0a, 10.0a, 12.0a: a letter after "
                       "the minor) when DeepSpeed builds a CUDA op: at run time, the first time the job loads one "
                       "(FusedAdam for an Adam or AdamW optimizer on the GPU, FusedAdamBuilder().load()), or at "
                       "install with DS_BUILD_FUSED_ADAM=1 or DS_BUILD_OPS=1; an arch list without a variant, or "
                       "none (the GPUs' own architectures), is not hit")

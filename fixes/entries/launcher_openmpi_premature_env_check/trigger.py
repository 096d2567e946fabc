"""The jobs that hit launcher-openmpi-premature-env-check's bug (``fixes.trigger``): measured by its
``reproduce.trigger_cells()``."""
from ...trigger import Trigger, uses, world_size

# The launcher builds its OpenMPI runner only for a launch over several nodes (two ranks or more), or with
# --force_multi; on one node it starts the ranks itself.
TRIGGER = Trigger(uses("openmpi-launch"), world_size(2),
                  note="launched by `deepspeed --launcher openmpi` over several nodes of a hostfile (or with "
                       "--force_multi), from a shell that is not itself an MPI rank")

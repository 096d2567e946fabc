"""The jobs that hit launcher-mpi-exports-quoted's bug (``fixes.trigger``): measured by its
``reproduce.trigger_cells()``."""
from ...trigger import Trigger, uses, world_size

# The launcher builds an MPI runner only for a launch over several nodes (two ranks or more), or with --force_multi;
# on one node it starts the ranks itself, with its own environment.
TRIGGER = Trigger(uses("mpi-launch"), world_size(2),
                  note="launched by `deepspeed --launcher openmpi|mpich|impi|mvapich` over several nodes of a "
                       "hostfile (or with --force_multi); pdsh, the default, is not hit (its shell removes the quotes)")

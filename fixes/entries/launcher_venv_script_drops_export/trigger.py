"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, world_size

# The bug is in how a job is launched, which no DeepSpeed config shows: the rank count is the only condition the
# trigger can read (a launch over several nodes has two ranks or more); the launch itself is in the note.
TRIGGER = Trigger(world_size(2),
                  note="launched by `deepspeed --venv_script ...` with the pdsh launcher (the default) over several "
                       "nodes of a hostfile (or with --force_multi); a job launched otherwise is not hit")

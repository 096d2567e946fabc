"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, uses

# No ZeRO stage: what matters is that zero.Init ran in the process (it replaces F.linear for good); a ZeRO-2 engine
# over a model built inside zero.Init hits it the same way (the grid's ZeRO-2 cell).
TRIGGER = Trigger(uses("zero-init"), uses("torch-func"),
                  note="unless zero_optimization.memory_efficient_linear is false: zero.Init then leaves F.linear "
                       "as it is")

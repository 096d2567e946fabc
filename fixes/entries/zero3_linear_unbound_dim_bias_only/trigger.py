"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

No ZeRO stage: what matters is that ``deepspeed.zero.Init`` ran in the process, which replaces
``torch.nn.functional.linear`` with ZeRO-3's linear for good (the grid's ZeRO-2 cell, over a model built after
``zero.Init`` ran for another one, crashes the same way). What no job field states is in the note: a Linear whose
bias is trainable and whose weight is not.
"""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("zero-init"),
                  note="with a Linear layer whose weight is frozen and whose bias is trainable (bias-only / BitFit "
                       "fine-tuning); unless zero_optimization.memory_efficient_linear is false: zero.Init then "
                       "leaves F.linear as it is")

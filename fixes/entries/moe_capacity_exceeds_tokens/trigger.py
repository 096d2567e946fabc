"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The crash needs a batch with fewer tokens than an expert's capacity, which no config shows (a short prompt at
evaluation or generation time, a small last batch), so that is in the note. So is top-1 gating with a capacity factor
above the number of experts, which crashes the same way: ``fixes.trigger.USES`` names top-k gating with k > 2 only.
"""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("moe-top-k"),
                  note="with token dropping on (the default) and a batch of fewer tokens than min_capacity (4 in MoE) "
                       "or than the capacity; top-1 gating with capacity_factor above the number of experts is hit "
                       "too; top-2 gating is not")

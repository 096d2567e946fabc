"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The crash needs token dropping turned off, ``MoE(..., drop_tokens=False)``: an argument of the layer that no
DeepSpeed config shows and ``fixes.trigger.USES`` does not name, so that is in the note.
"""
from ...trigger import Trigger, uses

TRIGGER = Trigger(uses("moe-top-k"),
                  note="with token dropping turned off (MoE(..., drop_tokens=False) or TopKGate(..., "
                       "drop_tokens=False)); with drop_tokens=True, the default, the layer runs")

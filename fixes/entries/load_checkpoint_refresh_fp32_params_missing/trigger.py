"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs ``engine.load_checkpoint(..., load_module_only=True)`` on an engine that keeps its optimizer as it is
(fp32 without ZeRO). A config cannot show the ``load_module_only`` argument, so it is in the note: a full
``load_checkpoint`` of the same job is not hit.
"""
from ...trigger import Trigger, precision, stage, uses

TRIGGER = Trigger(precision("fp32"), stage(0), uses("checkpoint-resume"),
                  note="with engine.load_checkpoint(..., load_module_only=True); a full load_checkpoint "
                       "(load_module_only=False, the default) is not hit")

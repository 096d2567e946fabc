"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

ZeRO-3 numbers every module of every ZeRO-3 model in ``module.id``; what the config cannot show is whether the
model has a module whose own ``id`` anything reads, so that is the note."""
from ...trigger import Trigger, stage

TRIGGER = Trigger(stage(3), note="and a module of the model has an attribute or property named id of its own "
                                 "(an expert's or layer's index, say): ZeRO-3 replaces its value, or fails to "
                                 "assign a read-only one")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

Every ZeRO-3 job's modules hold a ZeROOrderedDict; the bug shows when the job copies or pickles the model
(``copy.deepcopy``, ``pickle``, ``torch.save`` of a module), which no config shows and no listed use names, so
that is in the note.
"""
from ...trigger import Trigger, stage

TRIGGER = Trigger(stage(3), note="when the model (or a submodule) is copied with copy.deepcopy or pickled "
                                 "(pickle, torch.save of the module) after deepspeed.initialize: an EMA copy, "
                                 "a reference model")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs DeepSpeed's own Muon (the config's ``"optimizer": {"type": "Muon"}``) over a model with frozen
parameters: the use ``muon-frozen-params`` says both, since the trigger reads no optimizer type from a config.
ZeRO-3 refuses Muon before any group is built. Under ZeRO-1/2 the crash needs one half of Muon's split (the
matrices; the rest) to have no trainable parameter, which a config cannot show either: that is in the note.
"""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(0, 1, 2), uses("muon-frozen-params"),
                  note="under ZeRO-1/2 when every trainable parameter is a matrix (Muon's half) or none is (Adam's "
                       "half); under ZeRO-0 whenever a parameter is frozen")

"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

What a config cannot show and :data:`fixes.trigger.USES` has no word for is in the note: the job calls
``engine.offload_states()`` and then ``engine.reload_states()``, and its parameter groups list the parameters in
another order than ``model.parameters()`` (the weight-decay split does whenever a bias comes before a later
weight, as in every model of linear layers with biases).
"""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(3), uses("param-groups"),
                  note="and calls engine.offload_states() then engine.reload_states() (between RLHF generation and "
                       "training); groups that keep model.parameters() order are not hit")

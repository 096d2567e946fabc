"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs ``"elastic_checkpoint": true`` in ``zero_optimization`` and an optimizer whose state holds a 0-dim
tensor (a torch optimizer's step count: a client ``torch.optim.Adam`` / ``AdamW``, or the config's Adam with
``"torch_adam": true``). The trigger reads neither from a config (:func:`fixes.trigger.job_from_config` does not
read them), so both are in the note: with ``elastic_checkpoint`` off (the default) ``state_dict`` saves the torch
optimizer's own state_dict and never slices, and DeepSpeed's own optimizers keep their step count as a number.
"""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(1, 2), uses("checkpoint-resume"),
                  note='with "elastic_checkpoint": true in zero_optimization and a torch optimizer (its step count a '
                       '0-dim tensor); save_checkpoint alone fails, a resume is not needed')

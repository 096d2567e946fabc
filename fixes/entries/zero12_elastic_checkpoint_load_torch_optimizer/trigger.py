"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs ``"elastic_checkpoint": true`` in ``zero_optimization``, which the trigger cannot read from a config
(:class:`fixes.trigger.Job` has no field for it), so it is in the note: with ``elastic_checkpoint`` off (the default)
the checkpoint holds the torch optimizer's own ``state_dict`` and loads through torch. A torch optimizer that
DeepSpeed builds from the config (its Adam with ``"torch_adam": true``) hits it too; the use ``torch-optimizer``
names the client optimizer passed to ``deepspeed.initialize``, so the note says so.
"""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(1, 2), uses("torch-optimizer"), uses("checkpoint-resume"),
                  note='with "elastic_checkpoint": true in zero_optimization (a torch optimizer DeepSpeed builds '
                       'from the config, its Adam with "torch_adam": true, fails the same way)')

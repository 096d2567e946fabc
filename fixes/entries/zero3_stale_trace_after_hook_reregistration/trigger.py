"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

What a config cannot show and no listed use names is in the note: the hooks registered again between the first two
training steps (``deepspeed.runtime.zero.unwrap_model_for_generation``, or TRL's ``remove_hooks``/``add_hooks``
around generation), by a generation that does not run the outer module's forward.
"""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(3), uses("hooks-reregistered"),
                  note="with deepspeed.runtime.zero.unwrap_model_for_generation (or TRL's remove_hooks/add_hooks, "
                       "which its trainers run around generation) between the first two training steps, and a "
                       "generation that does not run the outer module's forward (a PEFT model's generate() calls its "
                       "base model's); a loop that never registers the hooks again is not hit")

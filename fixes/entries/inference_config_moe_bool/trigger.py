"""The jobs that hit inference-config-moe-bool's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug is in how ``deepspeed.init_inference`` is called (``moe`` given as a bool), which no training config shows:
the use is the only condition. Training jobs (``deepspeed.initialize``) never build ``DeepSpeedInferenceConfig``.
"""
from ...trigger import Trigger, uses

TRIGGER = Trigger(
    uses("init-inference-moe-bool"),
    note=("deepspeed.init_inference(model, moe=True) or moe=False, or \"moe\": true/false in its config dict; "
          "moe={\"enabled\": ...} (a dict) and a call without moe are not hit"))

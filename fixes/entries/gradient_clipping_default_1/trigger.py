"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, unset

TRIGGER = Trigger(unset("gradient_clipping", "no gradient_clipping in the config"),
                  note="it changes results where the gradient norm exceeds 1.0")

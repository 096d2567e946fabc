"""The jobs that hit ds-to-universal-adam-state-keys's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(1, 2), uses("ds-to-universal"), uses("optimizer-without-adam-state"))

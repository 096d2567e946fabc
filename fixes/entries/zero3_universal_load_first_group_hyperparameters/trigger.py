"""The jobs that hit zero3-universal-load-first-group-hyperparameters's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, stage, uses

TRIGGER = Trigger(stage(3), uses("ds-to-universal"), uses("param-groups"))

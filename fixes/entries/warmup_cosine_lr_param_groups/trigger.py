"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger, equals, uses

TRIGGER = Trigger(equals("scheduler", "WarmupCosineLR", "the WarmupCosineLR scheduler"), uses("param-groups"))

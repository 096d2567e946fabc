"""DeepSpeed Fixbook: proven fixes for real DeepSpeed bugs, applied with one call.

    import fixes
    fixes.apply("zero3-linear-setup-context")   # or fixes.apply() for every bug this install has
    engine, *_ = deepspeed.initialize(...)
    fixes.check(engine)                         # which known bugs this job, as configured, triggers
    ...
    fixes.revert()

See ``fixbook doctor`` for what the installed DeepSpeed needs, ``fixbook doctor --config ds_config.json`` for what
one job triggers.
"""
from .exceptions import (CannotTellError, DeepSpeedNotInstalledError, DriftError, FixbookError, FixbookWarning, PatchError, SweepFileError,
                         UnknownFixError)
from .fix import Fix, FixInfo, Outcome, Probe
from .job_check import check
from .registry import all_fixes, apply, available, get, revert

__version__ = "0.1.0"

__all__ = [
    "CannotTellError", "DeepSpeedNotInstalledError", "DriftError", "Fix", "FixInfo", "FixbookError", "FixbookWarning", "Outcome", "PatchError",
    "Probe", "SweepFileError", "UnknownFixError", "all_fixes", "apply", "available", "check", "get", "revert", "__version__"
]

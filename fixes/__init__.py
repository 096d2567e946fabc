"""DeepSpeed Fixbook: proven fixes for real DeepSpeed bugs, applied with one call.

    import fixes
    fixes.apply("zero3-linear-setup-context")   # or fixes.apply() for every bug this install has
    ...
    fixes.revert()

See ``fixbook doctor`` for what the installed DeepSpeed needs.
"""
from .exceptions import (CannotTellError, DeepSpeedNotInstalledError, DriftError, FixbookError, FixbookWarning, PatchError, SweepFileError,
                         UnknownFixError)
from .fix import Fix, FixInfo, Outcome, Probe
from .registry import all_fixes, apply, available, get, revert

__version__ = "0.1.0"

__all__ = [
    "CannotTellError", "DeepSpeedNotInstalledError", "DriftError", "Fix", "FixInfo", "FixbookError", "FixbookWarning", "Outcome", "PatchError",
    "Probe", "SweepFileError", "UnknownFixError", "all_fixes", "apply", "available", "get", "revert", "__version__"
]

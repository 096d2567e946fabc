"""One exception hierarchy for the Fixbook.

Every error the package raises on purpose derives from :class:`FixbookError`, so a training
script can ``except fixes.FixbookError`` around ``fixes.apply()`` and keep running unpatched.
"""
from __future__ import annotations


class FixbookError(Exception):
    """Base class of every error raised on purpose by the ``fixes`` package."""


class FixbookWarning(UserWarning):
    """A fix that ``fixes.apply()`` (no ids) could not apply; the others were applied."""


class UnknownFixError(FixbookError, KeyError):
    """An id that names no registered fix. The message lists the known ids."""

    def __init__(self, fix_id: str, known: list[str]) -> None:
        self.fix_id = fix_id
        self.known = known
        super().__init__(f"unknown fix id {fix_id!r}; known ids: {', '.join(known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DeepSpeedNotInstalledError(FixbookError):
    """DeepSpeed cannot be imported, so nothing can be probed or patched."""


class DriftError(FixbookError):
    """The code a fix targets is not the code it was written for; nothing was patched."""


class SweepFileError(FixbookError):
    """The measured version matrix (``fixes/data/sweep.json``) cannot be read; the message names the
    file and how to restore it."""


class PatchError(FixbookError):
    """Applying or reverting a patch failed half-way; it was rolled back."""


class HarnessError(FixbookError):
    """Base class of the notebook harness's errors."""


class RankFailedError(HarnessError):
    """A rank launched by the harness raised. Carries the child's exception type, text and traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        super().__init__(f"rank {rank} raised {exc_type}: {message}")


class RankTimeoutError(HarnessError):
    """Ranks launched by the harness did not finish in time (a hang); they were killed."""

    def __init__(self, timeout_s: float, finished: list[int], world_size: int) -> None:
        self.timeout_s = timeout_s
        self.finished = finished
        self.world_size = world_size
        pending = sorted(set(range(world_size)) - set(finished))
        super().__init__(f"ranks {pending} of {world_size} did not finish within {timeout_s:.0f} s "
                         f"(hang); finished ranks: {finished}")


class CannotTellError(HarnessError):
    """A reproduction ran but failed in a way that says nothing about the bug (the reference path
    itself failed, or the error came from elsewhere): the check cannot tell affected from not. The
    sweep records such a row as ``could not run``, with this message."""


class ToleranceError(HarnessError, AssertionError):
    """A comparison against the reference failed (or a reproduction found no difference)."""

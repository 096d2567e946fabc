"""How zero3-allreduce-fetch-padded-params is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. The run itself is in ``fetch.py`` beside it."""
from __future__ import annotations

from ...exceptions import CannotTellError


def reproduce(dtype: str = "float32") -> bool:
    """Two ranks, ZeRO-3 with ``stage3_use_all_reduce_for_fetch_params``, a model whose every parameter is
    padded, and PyTorch's ``torch.use_deterministic_algorithms(True, warn_only=True)`` (uninitialised memory
    filled with NaN, so the padding's contents are the same in every run). True if the first forward computes
    with weights other than the model's, or the losses or final weights differ from plain PyTorch data
    parallelism (beyond ``TOLERANCES``). One launch of two ranks."""
    import torch

    from ...exceptions import RankFailedError
    from . import fetch_wait_raises
    from .fetch import fetch_job, run

    if not hasattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory"):
        raise CannotTellError(f"torch {torch.__version__} does not fill uninitialised memory under "
                              "use_deterministic_algorithms (torch >= 2.1 does): what the padding holds would "
                              "depend on the allocator")
    try:
        result = run(fetch_job(dtype))
    except RankFailedError as exc:
        if "handle_dependency" in exc.message and fetch_wait_raises():
            raise CannotTellError("a training job with stage3_use_all_reduce_for_fetch_params cannot run on this "
                                  f"release: its first fetch raises {exc.exc_type}: {exc.message} (upstream PR "
                                  "#7414), before any fetched value is used") from exc
        raise
    return any(result.wrong) or not result.matches_reference

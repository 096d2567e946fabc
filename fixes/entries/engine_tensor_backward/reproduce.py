"""How engine-tensor-backward is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from ...exceptions import CannotTellError

from .attempts import Attempt, attempt, attempt_all
from .backward_modes import BackwardModes, backward_modes, backward_modes_all

__all__ = ["reproduce", "Attempt", "attempt", "attempt_all", "BackwardModes", "backward_modes",
           "backward_modes_all"]  # the notebook's names


def reproduce() -> bool:
    """Two jobs on one rank, each against ``engine.backward(loss)``: ZeRO-1, fp32, gas=2 through
    ``loss.backward()``, and ZeRO-1, fp16 (static loss scale) through ``engine.scale(loss).backward()``,
    the API PR #7665 gave for a direct backward that needs a loss scale. True when the direct backward
    crashes in ``engine.step()`` or gives other parameters, or ``engine.scale`` is missing or gives
    other parameters. Raises if a run fails anywhere else (then this check cannot tell)."""
    from ...harness import Job, compare

    job = Job(zero_stage=1, micro_steps=2)
    via_engine, direct = attempt(job), attempt(job.with_(backward="tensor"))
    if not via_engine.ok:
        raise CannotTellError(f"engine.backward itself failed here: {via_engine}")
    if direct.ok:
        direct_bug = not compare(direct.result.params, via_engine.result.params, job.dtype).close
    elif direct.call == "engine.step()":
        direct_bug = True
    else:
        raise CannotTellError(f"the direct backward failed outside engine.step(): {direct}")
    fp16 = Job(zero_stage=1, dtype="float16", steps=1)
    via_engine, scaled = attempt(fp16), attempt(fp16.with_(backward="scaled"))
    if not via_engine.ok:
        raise CannotTellError(f"engine.backward itself failed here (fp16): {via_engine}")
    if scaled.ok:
        scaled_bug = not compare(scaled.result.params, via_engine.result.params, fp16.dtype).close
    elif scaled.error.startswith("AttributeError") and "'scale'" in scaled.error:
        scaled_bug = True
    else:
        raise CannotTellError(f"engine.scale(loss).backward() failed otherwise: {scaled}")
    return direct_bug or scaled_bug


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=1, micro_steps=2, backward="tensor")


def bench_baseline_job():
    """The same job through ``engine.backward(loss)``, DeepSpeed's own API: what the fix makes ``loss.backward()`` do."""
    from ... import harness

    return harness.bench_job(zero_stage=1, micro_steps=2)

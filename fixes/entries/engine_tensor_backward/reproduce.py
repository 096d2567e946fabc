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


def differs_from_reference(job, world_size: int = 1) -> bool:
    """``job`` through DeepSpeed on ``world_size`` ranks (each its own shard of the data; one rank in this
    process), against plain-PyTorch data parallelism (each micro-loss divided by gas, gradients averaged over the
    ranks): True if a rank crashes in ``engine.step()`` or rank 0's parameters differ beyond the job's dtype
    tolerance; raises CannotTellError where a rank fails elsewhere."""
    from ...harness import compare, launch, train_reference

    attempts = [attempt(job)] if world_size == 1 else launch(attempt, world_size, job)
    failed = [run for run in attempts if not run.ok]
    if failed:
        if failed[0].call == "engine.step()":
            return True
        raise CannotTellError(f"the job failed outside engine.step(): {failed[0]}")
    return not compare(attempts[0].result.params, train_reference(job, world_size).params, job.dtype).close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ``loss.backward()`` on the engine's output with ZeRO-1 and
    gas=2 on one rank, then each of the three alternatives that suffice on its own (ZeRO-1 alone, gas=2 alone, two
    ranks alone: every condition holds in each), then each condition flipped on its own: ``loss.backward()``
    without ZeRO, with gas=1 on one rank (none of the alternatives), and ``engine.backward(loss)`` (the use off).
    Each cell trains two fp32 SGD steps against plain PyTorch; a crash in ``engine.step()`` counts as the bug.
    The fp16 half of ``reproduce()`` (``engine.scale``, the API PR #7665 added) is not a job condition: no cell."""
    from ...harness import Cell, Job, trigger_job

    def cell(label: str, job: Job, world_size: int = 1, flips: str = "") -> Cell:
        uses = ("direct-backward",) if job.backward == "tensor" else ()
        return Cell(label, trigger_job(job, world_size, uses=uses), lambda: differs_from_reference(job, world_size),
                    flips)

    direct = Job(zero_stage=1, micro_steps=2, backward="tensor")
    plain = direct.with_(zero_stage=0, micro_steps=1)
    return [cell("loss.backward(), ZeRO-1, gas 2, one rank", direct),
            cell("loss.backward(), ZeRO-1, gas 1, one rank", direct.with_(micro_steps=1)),
            cell("loss.backward(), ZeRO stage 0, gas 2, one rank", plain.with_(micro_steps=2)),
            cell("loss.backward(), ZeRO stage 0, gas 1, two ranks", plain, world_size=2),
            cell("loss.backward(), ZeRO stage 0, gas 1, one rank", plain,
                 flips="zero_stage|gradient_accumulation_steps|world_size"),
            cell("engine.backward(loss), ZeRO-1, gas 2, one rank", direct.with_(backward="engine"),
                 flips="uses:direct-backward")]

"""How zero23-no-sync-assertion is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the
fix or its probe.

``user_script()`` is one rank of a user's accelerate-style training loop (what ``accelerator.accumulate(model)``
and ``accelerator.backward(loss)`` do with a DeepSpeed engine); ``run_two_ranks()`` runs it on two gloo ranks,
each on its own shard of the data.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

from ...exceptions import CannotTellError, RankFailedError

WORLD_SIZE = 2
ASSERTION = re.compile(r"no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage (\d)")
# Other entries' bugs that break this entry's two-rank CPU runs where they are installed: ZeRO-2 fails in its
# first step() (zero12-flat-buffer-detach); ZeRO-3's coalesced parameter all-gather may hand the forward
# uninitialised memory on gloo (zero3-gathered-params-cpu-race).
MASKING_FIXES = ("zero12-flat-buffer-detach", "zero3-gathered-params-cpu-race")


def job(zero_stage: int = 2, dtype: str = "float32", **changes: Any) -> Any:
    """The harness job of this entry: ZeRO ``zero_stage``, four micro-batches per step, two steps, SGD. In
    bf16 the gradients are accumulated in fp32 (``data_types.grad_accum_dtype``), as plain PyTorch's
    reference accumulates them (ZeRO-2/3's default bf16 accumulation alone is outside the bf16 tolerance,
    with or without no_sync)."""
    from ...harness import Job

    config = {"data_types": {"grad_accum_dtype": "fp32"}} if dtype in ("bfloat16", "bf16") else {}
    return Job(zero_stage=zero_stage, dtype=dtype, micro_steps=4, steps=2, config=config).with_(**changes)


def user_script(job: Any, use_no_sync: bool = True, step_every_micro_batch: bool = False) -> dict[str, Any]:
    """One rank of an accelerate-style loop: every micro-batch but the last of a step runs inside
    ``engine.no_sync()`` (``accelerator.accumulate(model)``); ``accelerator.backward(loss)`` sets the
    accumulation boundary, runs ``engine.backward(loss)`` and, on the boundary, ``engine.step()``
    (``step_every_micro_batch``: older accelerate, which calls ``engine.step()`` after every backward).
    ``use_no_sync=False``: the same loop without ``no_sync``. Returns the trained parameters (gathered,
    fp32) and the gradient norm of each step."""
    import torch

    from ...harness import build_engine, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    engine = build_engine(job)  # deepspeed.initialize(model=TinyMLP(), optimizer=SGD, config=ds_config(job))
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    grad_norms = []
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            sync_gradients = micro == job.micro_steps - 1
            x, y = batches.micro(step, micro, rank)
            with contextlib.nullcontext() if sync_gradients or not use_no_sync else engine.no_sync():
                loss = mse(engine(x.to(device(), dtype)), y.to(device()))
                # accelerator.backward(loss) -> DeepSpeedEngineWrapper.backward(loss, sync_gradients=...)
                engine.set_gradient_accumulation_boundary(sync_gradients)
                engine.backward(loss)
                if sync_gradients or step_every_micro_batch:
                    engine.step()
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
    return {"params": gathered_params(engine.module), "grad_norms": grad_norms}


def run_two_ranks(job: Any, use_no_sync: bool = True, step_every_micro_batch: bool = False,
                  timeout: float = 180.0) -> list[dict[str, Any]]:
    """``user_script`` on two gloo ranks, each on its own shard of the data; raises RankFailedError as
    the script does (the first failing rank's exception)."""
    from ...harness import launch

    return launch(user_script, WORLD_SIZE, job, use_no_sync, step_every_micro_batch, timeout=timeout)


def with_and_without_no_sync(job: Any) -> dict[str, Any]:
    """One rank: ``user_script`` with ``no_sync``, then the same loop without it (a second engine, same data)."""
    return {"no_sync": user_script(job), "plain": user_script(job, use_no_sync=False)}


def with_and_without_no_sync_each(jobs: list[Any]) -> list[dict[str, Any]]:
    """One rank: :func:`with_and_without_no_sync` for each of ``jobs`` in turn, in the same two ranks (one launch
    for several configurations; every configuration builds its own engines)."""
    return [with_and_without_no_sync(each) for each in jobs]


def without_the_assertion(job: Any) -> dict[str, Any]:
    """One rank: ``user_script`` with DeepSpeed's ``no_sync`` minus its ZeRO assertion (what deleting that
    line would give: ``inside_no_sync_ctxt`` is set under ZeRO-2/3 too). Replaces the method in this rank's
    process only, which the launcher discards afterwards; never a fix."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    @contextlib.contextmanager
    def no_sync(self):
        assert not self.inside_no_sync_ctxt, "no_sync context manager reentry is unsupported"
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False

    DeepSpeedEngine.no_sync = no_sync
    return user_script(job)


def assertion_stage(error: RankFailedError) -> int | None:
    """The ZeRO stage named by no_sync's assertion in ``error``, or None where it is another error."""
    found = ASSERTION.search(error.message)
    return int(found.group(1)) if error.exc_type == "AssertionError" and found else None


def reproduce() -> bool:
    """Two ranks, ZeRO-2 then ZeRO-3, gas=2, one step, the accelerate-style loop: True if no_sync raises its
    ZeRO assertion, or if the loop with no_sync trains differently from the same loop without it (fp32
    tolerance). False where the engine has no ``no_sync`` (before 0.16.0): the loop cannot call it, so there is
    nothing to assert."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ...harness import compare, launch

    if not hasattr(DeepSpeedEngine, "no_sync"):
        return False
    for stage in (2, 3):
        stage_job = job(stage, micro_steps=2, steps=1)
        try:
            [rank0, _] = launch(with_and_without_no_sync, WORLD_SIZE, stage_job)
        except RankFailedError as exc:
            if assertion_stage(exc) == stage:
                return True
            raise CannotTellError(f"ZeRO-{stage}: the loop failed with another error: {exc.exc_type}: "
                                  f"{exc.message[:200]}") from exc
        if not compare(rank0["no_sync"]["params"], rank0["plain"]["params"], "float32").close:
            return True
    return False


@contextlib.contextmanager
def measurement_context() -> Iterator[None]:
    """Where a bug of :data:`MASKING_FIXES` is installed (its probe says so), its fix is applied for the
    measurement, so that ZeRO-2 on two CPU ranks gets past its first ``engine.step()`` and ZeRO-3's forward
    reads the parameters it gathered; a no-op elsewhere."""
    from ... import registry

    applied = [fix_id for fix_id in MASKING_FIXES
               if registry.get(fix_id).is_affected() and registry.apply(fix_id)[0].action == "applied"]
    try:
        yield
    finally:
        for fix_id in applied:
            registry.revert(fix_id)


def loop_and_plain(job: Any, use_no_sync: bool) -> dict[str, Any]:
    """One rank: ``user_script(job, use_no_sync)``, then the same loop without ``no_sync`` (a second engine,
    same data)."""
    return {"loop": user_script(job, use_no_sync), "plain": user_script(job, use_no_sync=False)}


def no_sync_breaks(job: Any, use_no_sync: bool = True) -> bool:
    """The accelerate-style loop of ``job`` on two ranks (``use_no_sync=False``: without ``no_sync``): True if
    ``no_sync`` raises its ZeRO assertion, or if the loop trains differently from the same loop without
    ``no_sync`` (fp32 tolerance); raises CannotTellError where a rank fails otherwise."""
    from ...harness import compare, launch

    try:
        [rank0, _] = launch(loop_and_plain, WORLD_SIZE, job, use_no_sync)
    except RankFailedError as exc:
        if assertion_stage(exc) == job.zero_stage:
            return True
        raise CannotTellError(f"ZeRO-{job.zero_stage}: the loop failed with another error: {exc.exc_type}: "
                              f"{exc.message[:200]}") from exc
    return not compare(rank0["loop"]["params"], rank0["plain"]["params"], "float32").close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the accelerate-style loop on two ranks with ZeRO-2 and gas=2,
    ZeRO-3 likewise (every condition too), then each condition flipped on its own: ZeRO-1, gas=1 (the loop then
    reaches the boundary on every micro-batch and never enters ``no_sync``, as accelerate's ``accumulate()`` does:
    the workaround users take), the loop without ``no_sync``. Each cell trains one fp32 step and tells whether
    ``no_sync`` raises its assertion or changes the training (:func:`no_sync_breaks`)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, stage_job: Any, flips: str = "", use_no_sync: bool = True) -> Cell:
        return Cell(label, trigger_job(stage_job, WORLD_SIZE, uses=("no-sync",) if use_no_sync else ()),
                    lambda: no_sync_breaks(stage_job, use_no_sync), flips)

    base = job(2, micro_steps=2, steps=1)
    return [cell("ZeRO-2, gas 2, no_sync before the boundary", base),
            cell("ZeRO-3, gas 2, no_sync before the boundary", job(3, micro_steps=2, steps=1)),
            cell("ZeRO-1 instead", job(1, micro_steps=2, steps=1), "zero_stage"),
            cell("gradient_accumulation_steps 1", job(2, micro_steps=1, steps=1), "gradient_accumulation_steps"),
            cell("the same loop without no_sync", base, "uses:no-sync", use_no_sync=False)]

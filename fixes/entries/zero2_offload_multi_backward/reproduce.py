"""How zero2-offload-multi-backward is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations


def reproduce() -> bool:
    """ZeRO-2 with CPU offload and two backward calls in one step, against plain PyTorch: True if they differ beyond the fp32 tolerance."""
    from ...harness import Job, versus_reference

    return not versus_reference("sweep", Job(zero_stage=2, offload=True, backwards=2, steps=1)).close


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=2, offload=True, backwards=2)


def boundary_by_hand(job) -> bool:
    """``job`` (``micro_steps`` micro-batches per step, ``gradient_accumulation_steps`` = ``micro_steps``) trained
    with the accumulation boundary set by hand, as a job with several backward calls per step does:
    ``engine.set_gradient_accumulation_boundary(last)`` before each ``engine.backward(loss)``, one ``engine.step()``
    per step. True if the parameters or the gradient norms differ from plain PyTorch beyond the fp32 tolerance."""
    from ...harness import build_engine, compare, device, gathered_params, make_batches, mse, train_reference
    from ...harness.compare import dtype_of

    engine = build_engine(job)
    batches = make_batches(job.model, job.steps, job.micro_steps, 1, job.micro_batch, job.data_seed)
    norms = []
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            x, y = batches.micro(step, micro, 0)
            engine.set_gradient_accumulation_boundary(micro == job.micro_steps - 1)
            engine.backward(mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device())))
        engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    reference = train_reference(job)
    return not (compare(gathered_params(engine.module), reference.params, job.dtype).close
                and compare(norms, reference.grad_norms, job.dtype).close)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-2 with CPU offload, gradient_accumulation_steps 1 and two
    backward calls per step (the boundary set by hand), then each condition flipped on its own: ZeRO-1 with the same
    offload, no offload, gradient_accumulation_steps 2 with the same two backward calls and the boundary still set by
    hand (:func:`boundary_by_hand`), one backward call per step. Each cell trains one step against plain PyTorch
    (fp32 tolerance); two micro-batches, so zero2-offload-grad-accum (three or more) stays out of the gas cell."""
    from ...harness import Cell, Job, trigger_job, versus_reference

    def cell(label: str, job: Job, flips: str = "", uses: tuple[str, ...] = ("several-backward",)) -> Cell:
        return Cell(label, trigger_job(job, uses=uses), lambda: not versus_reference("trigger", job).close, flips)

    base = Job(zero_stage=2, offload=True, backwards=2, steps=1)
    by_hand = Job(zero_stage=2, offload=True, micro_steps=2, steps=1)
    return [cell("ZeRO-2, offload_optimizer to CPU, two engine.backward calls per step", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("without offload_optimizer", base.with_(offload=False), "offload_optimizer"),
            Cell("gradient_accumulation_steps 2, the same two backward calls, boundary set by hand",
                 trigger_job(by_hand, uses=("several-backward",)), lambda: boundary_by_hand(by_hand),
                 "gradient_accumulation_steps"),
            cell("one engine.backward call per step", base.with_(backwards=1), "uses:several-backward", uses=())]

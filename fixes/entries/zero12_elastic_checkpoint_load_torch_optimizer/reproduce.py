"""How zero12-elastic-checkpoint-load-torch-optimizer is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix of its own applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe.

The user's job: ZeRO-1 or 2 with ``"elastic_checkpoint": true``, a client ``torch.optim.Adam`` (lr 0.01),
:data:`SAVED_AFTER` steps, ``engine.save_checkpoint``, a fresh engine ``engine.load_checkpoint``, the remaining steps
to :data:`STEPS`; compared (``fixes.harness.resume.resume_versus``) with the uninterrupted DeepSpeed run and with
plain PyTorch.

Where entry zero12-checkpoint-zero-dim-state's bug is installed such a checkpoint cannot be saved at all, so the sweep
measures this entry with that entry's fix applied (:func:`measurement_context`), as this fix ``requires``; likewise
entry torch-load-weights-only-default's, where DeepSpeed's own ``torch.load`` of the checkpoint fails first (a torch
that loads weights only by default).
"""
from __future__ import annotations

import contextlib
import tempfile
import traceback
from typing import Any, Iterator

from ...exceptions import CannotTellError

STEPS = 4  # optimizer steps in all
SAVED_AFTER = 2  # the checkpoint is saved after this many; the fresh engine loads it and runs the rest
LR = 0.01
FAILING_FUNCTION = "_restore_step_from_elastic_checkpoint"
# entries whose bugs stop this job before the load this entry is about (applied where installed)
PREREQUISITES = ("zero12-checkpoint-zero-dim-state", "torch-load-weights-only-default")


def elastic_job(stage: int = 1, **changes: Any) -> Any:
    """ZeRO ``stage`` with ``"elastic_checkpoint": true``, a client ``torch.optim.Adam`` (lr :data:`LR`), fp32,
    :data:`STEPS` steps."""
    from ...harness import Job

    return Job(zero_stage=stage, optimizer="adam", lr=LR, steps=STEPS,
               config={"zero_optimization": {"stage": stage, "elastic_checkpoint": True}}).with_(**changes)


def is_this_error(error: BaseException) -> bool:
    """The bug's error: the bare ``AssertionError`` of ``assert BASE_OPTIMIZER_STATE_STEP in all_state_dict[0]`` in
    ``DeepSpeedZeroOptimizer._restore_step_from_elastic_checkpoint``."""
    if not isinstance(error, AssertionError):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].name == FAILING_FUNCTION


def where(error: BaseException) -> str:
    """``error`` as one line: its type, the function that raised it, and its message (the failing line where it
    has none, as a bare ``assert`` has)."""
    frames = traceback.extract_tb(error.__traceback__)
    origin = f" in {frames[-1].name}" if frames else ""
    detail = str(error) or (f"`{frames[-1].line}`" if frames and frames[-1].line else "")
    return f"{type(error).__name__}{origin}{': ' + detail if detail else ''}".splitlines()[0][:300]


def resume(job: Any, label: str = "") -> Any:
    """``fixes.harness.resume.resume_versus`` for ``job`` saved after :data:`SAVED_AFTER` steps: the resumed run
    against the uninterrupted one and plain PyTorch. Whatever ``load_checkpoint`` raises propagates."""
    from ...harness.resume import resume_versus

    return resume_versus(label or f"ZeRO-{job.zero_stage}, {job.dtype}", job, SAVED_AFTER)


def load_fails(job: Any) -> bool:
    """True if ``load_checkpoint`` of ``job``'s checkpoint raises this bug's AssertionError; False if it loads and the
    resumed run matches the uninterrupted one and plain PyTorch; CannotTellError otherwise."""
    try:
        result = resume(job)
    except AssertionError as error:
        if is_this_error(error):
            return True
        raise CannotTellError(f"the resume failed otherwise: {where(error)}") from error
    except Exception as error:  # noqa: BLE001 - a failure elsewhere says nothing about this bug
        raise CannotTellError(f"the resume failed otherwise: {where(error)}") from error
    if not result.close:
        outside = [key for key, comparison in result.comparisons.items() if not comparison.close]
        raise CannotTellError(f"load_checkpoint loaded, but the resumed run differs: {', '.join(outside)}")
    return False


def reproduce() -> bool:
    """ZeRO-1, ``elastic_checkpoint``, a client torch Adam: save after two steps, load into a fresh engine, train on.
    True if ``load_checkpoint`` stops at the assertion in ``_restore_step_from_elastic_checkpoint``; False if the
    resumed run ends where the uninterrupted one and plain PyTorch do."""
    return load_fails(elastic_job())


@contextlib.contextmanager
def measurement_context() -> Iterator[None]:
    """Each of :data:`PREREQUISITES` applied where its bug is installed (and reverted after), as the fix
    ``requires``: without them the checkpoint cannot be saved, or DeepSpeed's ``torch.load`` of it fails, before the
    load step this entry is about."""
    from ...harness.entry import fixed_where_installed

    with contextlib.ExitStack() as stack:
        for fix_id in PREREQUISITES:
            stack.enter_context(fixed_where_installed(fix_id))
        yield


# ---- the trigger's grid ------------------------------------------------------------------------------------------

def _config_optimizer_engine(job: Any) -> Any:
    """``deepspeed.initialize`` with the optimizer the config of ``job`` names (DeepSpeed builds its own)."""
    import deepspeed

    from ...harness import TinyMLP, ds_config

    model = TinyMLP(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(job))
    return engine


def config_optimizer_load_fails(job: Any) -> bool:
    """As :func:`load_fails`, with the optimizer the config names (DeepSpeed's own): True if ``load_checkpoint``
    raises this bug's error; False if the resumed run ends where the uninterrupted one does (weights and the
    optimizer's state); CannotTellError otherwise."""
    from ...harness import compare, gathered_params, make_batches
    from ...harness.resume import optimizer_state, train_steps

    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch, job.data_seed)
    whole = _config_optimizer_engine(job)
    train_steps(whole, job, batches, range(job.steps))
    with tempfile.TemporaryDirectory(prefix="fixbook-elastic-load-grid-") as directory:
        first = _config_optimizer_engine(job)
        train_steps(first, job, batches, range(SAVED_AFTER))
        first.save_checkpoint(directory)
        second = _config_optimizer_engine(job)
        try:
            second.load_checkpoint(directory)
        except Exception as error:  # noqa: BLE001
            if is_this_error(error):
                return True
            raise CannotTellError(f"the resume failed otherwise: {where(error)}") from error
        train_steps(second, job, batches, range(SAVED_AFTER, job.steps))
    pairs = {"weights": (gathered_params(second.module), gathered_params(whole.module))}
    resumed, uninterrupted = optimizer_state(second.optimizer), optimizer_state(whole.optimizer)
    pairs.update({name: (resumed[name], uninterrupted[name]) for name in ("exp_avg", "exp_avg_sq")})
    outside = [name for name, (a, b) in pairs.items() if not compare(a, b, job.dtype, name).close]
    if outside:
        raise CannotTellError(f"load_checkpoint loaded, but the resumed run differs in {', '.join(outside)}")
    return False


def trains_only(job: Any) -> bool:
    """``job`` trained through ``deepspeed.initialize`` with no checkpoint: it never reaches this bug's code."""
    from ...harness import build_engine, make_batches
    from ...harness.resume import train_steps

    engine = build_engine(job)
    train_steps(engine, job, make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch,
                                          job.data_seed), range(job.steps))
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (ZeRO-1, ``elastic_checkpoint``, a client
    torch Adam, save and load), the same under ZeRO-2, in bf16, and with a client ``torch.optim.SGD`` (no step count
    at all): every condition holds in each. Then each condition flipped on its own: ZeRO-0 (not ZeRO-3, which refuses
    ``elastic_checkpoint`` on save with an error of its own); DeepSpeed's own optimizer from the config
    (``"optimizer": {"type": "AdamW"}``: FusedAdam, which keeps its step count in the parameter groups); and a job
    that trains and never saves a checkpoint. Not in the grid, because the trigger cannot read them from a config
    (they are in its note): ``elastic_checkpoint`` off (the default), and the config's Adam with ``"torch_adam":
    true`` (a torch AdamW built by DeepSpeed, which hits the bug too)."""
    from ...harness import Cell, trigger_job

    optimizer, resumes = "torch-optimizer", "checkpoint-resume"

    def cell(label: str, job: Any, used: tuple[str, ...], run: Any, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, uses=used), lambda: run(job), flips)

    base = elastic_job()
    own_adam = base.with_(config={"optimizer": {"type": "AdamW", "params": {"lr": LR}},
                                  "zero_optimization": {"stage": 1, "elastic_checkpoint": True}})
    return [cell("ZeRO-1, elastic_checkpoint, torch.optim.Adam, save and load_checkpoint", base,
                 (optimizer, resumes), load_fails),
            cell("the same under ZeRO-2", elastic_job(2), (optimizer, resumes), load_fails),
            cell("the same in bf16", base.with_(dtype="bfloat16"), (optimizer, resumes), load_fails),
            cell("torch.optim.SGD instead of Adam", base.with_(optimizer="sgd"), (optimizer, resumes), load_fails),
            cell("ZeRO-0 instead", elastic_job(0), (optimizer, resumes), load_fails, "zero_stage"),
            cell('DeepSpeed\'s own AdamW from the config ("optimizer": {"type": "AdamW"}) instead', own_adam,
                 (resumes,), config_optimizer_load_fails, f"uses:{optimizer}"),
            cell("no checkpoint: the job only trains", base, (optimizer,), trains_only, f"uses:{resumes}")]


# ---- a resume on several ranks (the entry's tests) ---------------------------------------------------------------

def rank_resumes(job: Any, checkpoint_dir: str) -> dict[str, Any]:
    """One rank of ``job`` on ``WORLD_SIZE`` ranks (run by ``fixes.harness.launch``): :data:`SAVED_AFTER` steps on
    this rank's shard of the harness's batches, ``engine.save_checkpoint(checkpoint_dir)``, a fresh engine
    ``load_checkpoint`` s it and trains to ``job.steps``. Returns this rank's optimizer state when it saved
    (``saved``) and right after the load (``loaded``), and the gathered weights at the end (``weights``)."""
    import os

    from ...harness import build_engine, gathered_params, make_batches
    from ...harness.resume import optimizer_state, train_steps

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, world_size, job.micro_batch,
                           job.data_seed)
    first = build_engine(job)
    train_steps(first, job, batches, range(SAVED_AFTER))
    first.save_checkpoint(checkpoint_dir)
    saved = optimizer_state(first.optimizer)
    second = build_engine(job)
    if second.load_checkpoint(checkpoint_dir)[0] is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {checkpoint_dir}")
    loaded = optimizer_state(second.optimizer)
    train_steps(second, job, batches, range(SAVED_AFTER, job.steps))
    return {"saved": saved, "loaded": loaded, "weights": gathered_params(second.module)}

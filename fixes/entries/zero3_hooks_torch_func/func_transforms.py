"""``torch.func`` transforms over a whole ZeRO-3 model, run in child ranks, and the same transforms on
the plain-PyTorch model as the reference.

A transform can kill the Python process (SIGSEGV), so :func:`run_case_in_child` always runs it in
fresh ranks via :func:`fixes.harness.launch` and turns the outcome, crash included, into a
:class:`CaseOutcome` the notebook records.

Transforms (each on this rank's inputs ``x``, targets ``y``, loss = MSE):

* ``grad`` — ``torch.func.grad`` of the loss with respect to ``x`` through ``engine.module``;
* ``grad_and_value`` — the same with the loss value;
* ``jacrev`` — the Jacobian of the model's output with respect to ``x``;
* ``vmap_grad`` — per-sample input gradients, ``vmap`` over ``grad``;
* ``param_grad`` — the gradient with respect to every parameter through
  ``torch.func.functional_call`` on the parameters gathered by ``deepspeed.zero.GatheredParameters``
  (what a user writes first);
* ``param_grad_helper`` — the same through :func:`fixes.zero3.functional_call`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ...exceptions import RankFailedError
from ...harness.models import TinyMLP, make_batches, mse
from ...harness.training import Job, gathered_params, original_functional_linear

TRANSFORMS = ("grad", "grad_and_value", "jacrev", "vmap_grad", "param_grad", "param_grad_helper")

# What each failure looks like; the first that matches names the symptom.
SYMPTOMS: dict[str, Callable[[RankFailedError], bool]] = {
    "SIGSEGV": lambda e: e.exc_type == "ProcessDied" and "SIGSEGV" in e.message,
    "setup_context error": lambda e: "must override the setup_context staticmethod" in e.message,
    "functorch level assert": lambda e: "level <= current_level INTERNAL ASSERT FAILED" in e.message,
    "ds_status AttributeError": lambda e: e.exc_type == "AttributeError" and "ds_status" in e.message,
    # where ZeRO-3's reset_step (root module's forward pre-hook) calls .numpy() on a tensor made inside
    # the transform
    "no-storage error in reset_step": lambda e: ("Cannot access data pointer of Tensor that doesn't have storage"
                                                 in e.message and "reset_step" in e.traceback),
}


def zero3_func_job(**changes: Any) -> Job:
    """A ZeRO-3 job built inside ``deepspeed.zero.Init`` with every parameter partitioned and
    released after use (``stage3_param_persistence_threshold: 0``: the tiny model would otherwise
    keep all its parameters gathered after the first forward)."""
    job = Job(zero_stage=3, zero3_init=True, steps=2,
              config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    return job.with_(**changes)


@dataclass(frozen=True)
class FuncCase:
    """Which transforms to run over which job, with which fixes applied first, and whether to train
    ``job.steps`` steps with the same engine afterwards (to show the engine still trains correctly)."""

    job: Job
    transforms: tuple[str, ...] = ("grad",)
    fixes: tuple[str, ...] = ()
    train_after: bool = False
    repeat: int = 1  # run each transform this many times; a failure is raised after the last one
    # After a failed transform, run one ordinary training step with the same engine before raising,
    # as a script that catches the error would (it shows whether the process survives the failure).
    train_after_failure: bool = False
    trail: str = ""  # a file the rank appends what it did to, line by line (read back even after a crash)

    def __post_init__(self) -> None:
        unknown = set(self.transforms) - set(TRANSFORMS)
        if unknown:
            raise ValueError(f"unknown transforms {sorted(unknown)}; known: {', '.join(TRANSFORMS)}")


@dataclass
class CaseOutcome:
    """What a child run of a :class:`FuncCase` gave: per-rank results, or the failure."""

    case: FuncCase
    world_size: int
    results: list[dict[str, Any]] = field(default_factory=list)
    error: RankFailedError | None = None
    trail: list[str] = field(default_factory=list)  # what the rank reported before it finished or died

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def symptom(self) -> str | None:
        """The known symptom the failure shows (None: ran, or failed some other way)."""
        if self.error is None:
            return None
        return next((name for name, matches in SYMPTOMS.items() if matches(self.error)), None)

    @property
    def error_line(self) -> str:
        """The failure in one line: exception type and message, or the signal."""
        if self.error is None:
            return ""
        return f"{self.error.exc_type}: {self.error.message}".splitlines()[0]

    @property
    def deepspeed_frames(self) -> list[str]:
        """``file:line in function`` of every DeepSpeed frame of the child's traceback, outermost first
        (none for a crash: a killed process leaves no traceback)."""
        import re

        frames = []
        for line in (self.error.traceback if self.error else "").splitlines():
            match = re.match(r'\s*File "(.*?/deepspeed/(.*?))", line (\d+), in (\S+)', line)
            if match:
                frames.append(f"deepspeed/{match.group(2)}:{match.group(3)} in {match.group(4)}")
        return frames

    @property
    def failing_frame(self) -> str:
        """The innermost three DeepSpeed frames of the child's traceback, innermost last."""
        return " -> ".join(self.deepspeed_frames[-3:])

    def __str__(self) -> str:
        if self.error is None:
            return f"{', '.join(self.case.transforms)} on {self.world_size} rank(s): ran"
        return (f"{', '.join(self.case.transforms)} on {self.world_size} rank(s): FAILED ({self.symptom or 'other'}) "
                f"— {self.error_line[:300]}" + (f"\n    at {self.failing_frame}" if self.failing_frame else ""))


def rank_inputs(job: Job, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets (the first micro-batch of the job's data)."""
    batches = make_batches(job.model, 1, 1, world_size, job.micro_batch, job.data_seed + 100)
    return batches.micro(0, 0, rank)


def apply_transform(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                    zero3: bool = False) -> dict[str, torch.Tensor]:
    """Run one transform over ``model``; ``zero3``: the model's parameters are ZeRO-3 partitioned
    (the parameter-gradient transforms then gather them first)."""
    def loss(inp: torch.Tensor) -> torch.Tensor:
        return mse(model(inp), y)

    if name == "grad":
        return {"grad": torch.func.grad(loss)(x)}
    if name == "grad_and_value":
        grad, value = torch.func.grad_and_value(loss)(x)
        return {"grad": grad, "value": value}
    if name == "jacrev":
        return {"jacobian": torch.func.jacrev(model)(x)}
    if name == "vmap_grad":
        per_sample = torch.func.vmap(torch.func.grad(lambda xi, yi: mse(model(xi[None]), yi[None])))(x, y)
        return {"per_sample_grad": per_sample}
    if name in ("param_grad", "param_grad_helper"):
        return {f"d/d {key}": grad for key, grad in _param_grads(name, model, x, y, zero3).items()}
    raise ValueError(f"unknown transform {name!r}")


def _param_grads(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 zero3: bool) -> dict[str, torch.Tensor]:
    call: Callable[..., Any] = torch.func.functional_call
    if not zero3:
        gathered: Any = contextlib.nullcontext({key: p.detach() for key, p in model.named_parameters()})
    elif name == "param_grad":  # what a user writes first: gather, then torch.func.functional_call
        gathered = _gathered_detached(model)
    else:
        from ...zero3 import functional_call, gathered_parameters

        gathered, call = gathered_parameters(model), functional_call
    with gathered as params:
        return torch.func.grad(lambda p: mse(call(model, p, (x, )), y))(params)


@contextlib.contextmanager
def _gathered_detached(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    import deepspeed

    named = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values())):
        yield {key: p.detach() for key, p in named.items()}


def whole_model_rank(case: FuncCase) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): apply ``case.fixes``, build the ZeRO-3 engine of
    ``case.job``, run each transform over ``engine.module`` with its parameters partitioned, then
    (``train_after``) train ``job.steps`` steps with the same engine. Returns numpy results."""
    import fixes

    from ...harness.env import device
    from ...harness.training import build_engine

    def note(line: str) -> None:
        if case.trail:
            with open(case.trail, "a") as handle:
                handle.write(f"rank {rank}: {line}\n")

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if case.fixes:
        note("; ".join(str(outcome) for outcome in fixes.apply(*case.fixes)))
    engine = build_engine(case.job)
    model = engine.module
    x, y = (t.to(device()) for t in rank_inputs(case.job, world_size, rank))
    out: dict[str, Any] = {}
    for name in case.transforms:
        # Memory corruption does not fail the same way every time (an assert or SIGSEGV): repeating
        # shows whether the process survives it.
        failures: list[BaseException] = []
        for attempt in range(case.repeat):
            note(f"{name} (attempt {attempt + 1}) ...")
            try:
                out.update(apply_transform(name, model, x, y, zero3=True))
                note(f"{name} (attempt {attempt + 1}) returned")
            except Exception as exc:  # noqa: BLE001 - re-raised below
                note(f"{name} (attempt {attempt + 1}) raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                failures.append(exc)
        if failures:
            if case.train_after_failure:
                wrapped = [key for key, p in model.named_parameters() if torch._C._functorch.is_gradtrackingtensor(p)]
                note(f"parameters that are now functorch wrappers: {wrapped or 'none'}")
                note("one ordinary training step with the same engine ...")
                engine.backward(mse(engine(x), y))
                engine.step()
                note("the training step returned")
            raise failures[0]
    out["parameters released after the transforms"] = np.array(
        [getattr(p, "ds_status", None) is not None and p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters()])
    if case.train_after:
        batches = make_batches(case.job.model, case.job.steps, 1, world_size, case.job.micro_batch, case.job.data_seed)
        for step in range(case.job.steps):
            xs, ys = batches.micro(step, 0, rank)
            engine.backward(mse(engine(xs.to(device())), ys.to(device())))
            engine.step()
        out.update({f"trained {key}": value for key, value in gathered_params(model).items()})
    return out


def run_case_in_child(case: FuncCase, world_size: int = 1, timeout: float = 180.0) -> CaseOutcome:
    """Run :func:`whole_model_rank` on ``world_size`` fresh ranks; a crash or an exception becomes
    the outcome's ``error``, and what the ranks reported on the way is its ``trail`` (a hang still
    raises RankTimeoutError)."""
    import dataclasses
    import tempfile

    from ...harness.launch import launch

    with tempfile.TemporaryDirectory() as scratch:
        trail = os.path.join(scratch, "trail.txt")
        case = dataclasses.replace(case, trail=trail)
        try:
            outcome = CaseOutcome(case, world_size, results=launch(whole_model_rank, world_size, case, timeout=timeout))
        except RankFailedError as exc:
            outcome = CaseOutcome(case, world_size, error=exc)
        if os.path.exists(trail):
            with open(trail) as handle:
                outcome.trail = handle.read().splitlines()
    return outcome


def reference_transforms(case: FuncCase, world_size: int = 1) -> list[dict[str, Any]]:
    """The same transforms per rank on the plain-PyTorch TinyMLP (PyTorch's own ``F.linear``), and
    with ``train_after`` the parameters after plain data-parallel training (:func:`train_reference`)."""
    from ...harness.launch import to_numpy
    from ...harness.training import train_reference

    per_rank = []
    with original_functional_linear():
        model = TinyMLP(case.job.model)
        for rank in range(world_size):
            x, y = rank_inputs(case.job, world_size, rank)
            out: dict[str, Any] = {}
            for name in case.transforms:
                out.update(apply_transform(name, model, x, y))
            per_rank.append(to_numpy(out))
    if case.train_after:
        trained = train_reference(case.job, world_size=world_size).params
        for out in per_rank:
            out.update({f"trained {key}": value for key, value in trained.items()})
    return per_rank


def compare_outcome(outcome: CaseOutcome, reference: list[dict[str, Any]], dtype: str = "float32") -> list[Any]:
    """One :class:`~fixes.harness.compare.Comparison` per rank and result the reference has."""
    from ...harness.compare import compare

    comparisons = []
    for rank, (got, want) in enumerate(zip(outcome.results, reference)):
        for key in want:
            comparisons.append(compare(got[key], want[key], dtype, f"rank {rank}: {key}"))
    return comparisons


# The mechanism with no DeepSpeed at all: what ZeRO-3's gather does to a parameter under a transform.
PARAMETER_DATA_DEMO = """
import torch

param = torch.nn.Parameter(torch.empty(0))  # a partitioned ZeRO-3 parameter holds no data
x = torch.randn(4, 8)


def loss(x):
    with torch.no_grad():  # what ZeRO-3's fetch does: param.data = <all-gathered buffer>.narrow().view()
        param.data = torch.randn(128).narrow(0, 0, 128).view(16, 8)
    print("after param.data = ... inside torch.func.grad: is_gradtrackingtensor(param) =",
          torch._C._functorch.is_gradtrackingtensor(param), flush=True)
    return (x @ param.t()).sum()


torch.func.grad(loss)(x)
print("torch.func.grad returned", flush=True)
"""


@dataclass(frozen=True)
class DemoResult:
    returncode: int
    output: str  # the first lines the child printed, and its last line (the exception, if it raised one)

    @property
    def signal(self) -> str | None:
        """``SIGSEGV`` etc. when the process was killed by a signal."""
        import signal

        return signal.Signals(-self.returncode).name if self.returncode < 0 else None

    @property
    def ended(self) -> str:
        """How the child ended, in words: killed by a signal, raised (the exception line), or returned."""
        if self.signal:
            return f"killed by {self.signal}"
        if self.returncode:
            return f"exit code {self.returncode}: {self.output.splitlines()[-1]}"
        return "exit code 0"

    @property
    def parameter_became_wrapper(self) -> bool:
        """The child saw the assigned parameter turn into a functorch GradTrackingTensor."""
        return "is_gradtrackingtensor(param) = True" in self.output

    @property
    def transform_returned(self) -> bool:
        return "torch.func.grad returned" in self.output


def parameter_data_demo(timeout: float = 120) -> DemoResult:
    """Run :data:`PARAMETER_DATA_DEMO` (plain PyTorch) in a child Python process and return how it ended.

    What the broken wrapper does at its next use is undefined: on the machines measured the child died
    with SIGSEGV, on CI once it raised from inside ``torch.func.grad`` instead. Either way the
    transform does not return."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PARAMETER_DATA_DEMO], capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    kept = lines[:6] + (["..."] + lines[-1:] if len(lines) > 6 else [])
    return DemoResult(done.returncode, "\n".join(kept))

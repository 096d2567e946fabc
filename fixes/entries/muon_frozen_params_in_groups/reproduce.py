"""How muon-frozen-params-in-groups is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

Also what the notebook and the tests share with it: :func:`muon_job` (the user's job: the config's
``"optimizer": {"type": "Muon"}`` over the harness's two-layer MLP), :data:`FROZEN` (which parameters the user
freezes), :func:`train` (the job through ``deepspeed.initialize`` with ``model_parameters=model.parameters()``),
:func:`outcome` (what the job does: raises this bug's error, changes a frozen parameter, or trains) and
:func:`reference` (the same job in plain PyTorch: :class:`PlainMuon`, Keller Jordan's Muon update, for the
matrices and ``torch.optim.AdamW`` for the rest, as DeepSpeed's ``MuonWithAuxAdam`` splits them).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from ...exceptions import CannotTellError

LR = 0.02
MOMENTUM = 0.95
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)  # the Adam half's (MuonWithAuxAdam's defaults, set in the config)
ADAM_EPS = 1e-10
STEPS = 3

# Which parameters the user freezes (requires_grad=False), by name: DeepSpeed tags matrices (ndim >= 2) use_muon.
FROZEN: dict[str, Callable[[str, Any], bool]] = {
    "biases": lambda name, p: p.ndim < 2,  # only the weight matrices train: every trainable parameter is Muon's
    "weights": lambda name, p: p.ndim >= 2,  # only the biases train: every trainable parameter is Adam's
    "fc1": lambda name, p: name.startswith("fc1."),  # the first layer: both halves keep a trainable parameter
    "nothing": lambda name, p: False,
}
FROZEN_LABELS = {"biases": "the biases (only matrices train)", "weights": "the weights (only biases train)",
                 "fc1": "the first layer (fc1)", "nothing": "nothing"}

# This bug's errors: ZeRO-1/2 flattening a group of frozen parameters at initialize; ZeRO-0's Muon step on a
# frozen matrix, whose grad is None.
CAT_ERROR = "torch.cat(): expected a non-empty list of Tensors"
RESHAPE_ERROR = "'NoneType' object has no attribute 'reshape'"


def has_deepspeed_muon() -> bool:
    """Whether the installed DeepSpeed has its own Muon (``deepspeed/runtime/zero/muon``). Without it the config's
    ``"type": "Muon"`` falls through to ``getattr(torch.optim, "Muon")``, which is another optimizer."""
    return importlib.util.find_spec("deepspeed.runtime.zero.muon") is not None


def muon_config(stage: int) -> dict[str, Any]:
    """The config's optimizer block and ZeRO stage, as a user writes them. ``"torch_adam": true``: where DeepSpeed
    gives Muon's Adam half an optimizer of its own (newer releases: FusedAdam, compiled at first use), it is
    torch's AdamW, nothing to compile; releases whose Muon steps the Adam half itself ignore the key."""
    return {"optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY,
                                                     "betas": list(ADAM_BETAS), "eps": ADAM_EPS, "torch_adam": True}},
            "zero_optimization": {"stage": stage}}


def muon_job(stage: int = 1, **changes: Any) -> Any:
    """The harness job with DeepSpeed's Muon (the config's optimizer block) under ZeRO ``stage``, fp32."""
    from ...harness import Job

    return Job(zero_stage=stage, steps=STEPS, lr=LR, config=muon_config(stage)).with_(**changes)


def frozen_model(frozen: str, spec: Any = None) -> Any:
    """The harness's TinyMLP with the parameters ``FROZEN[frozen]`` names set to ``requires_grad=False``."""
    from ...harness import ModelSpec, TinyMLP

    model = TinyMLP(spec or ModelSpec())
    for name, param in model.named_parameters():
        if FROZEN[frozen](name, param):
            param.requires_grad_(False)
    return model


def build(job: Any, frozen: str) -> Any:
    """``deepspeed.initialize(model=..., model_parameters=model.parameters(), config=...)`` with ``frozen`` frozen;
    whatever it raises propagates."""
    import deepspeed

    import fixes

    from ...harness import ds_config

    if job.fixes:
        fixes.apply(*job.fixes)
    model = frozen_model(frozen, job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(job))
    return engine


@dataclass(frozen=True)
class Trained:
    """A job's parameters before and after training, which of them were frozen, and the optimizer's groups."""

    before: dict[str, Any]
    after: dict[str, Any]
    frozen: tuple[str, ...]
    groups: list[dict[str, Any]]

    def changed_frozen(self) -> list[str]:
        import numpy as np

        return [name for name in self.frozen if not np.array_equal(self.before[name], self.after[name])]


def train(job: Any, frozen: str) -> Trained:
    """``job.steps`` steps of the user's loop (engine(x), mse, engine.backward, engine.step) on the harness's
    batches; whatever DeepSpeed raises propagates."""
    from ...harness import device, dtype_of, gathered_params, make_batches, mse

    engine = build(job, frozen)
    before = gathered_params(engine.module)
    names = tuple(name for name, p in engine.module.named_parameters() if not p.requires_grad)
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
    return Trained(before, gathered_params(engine.module), names, optimizer_groups(engine))


def optimizer_groups(engine: Any) -> list[dict[str, Any]]:
    """DeepSpeed's Muon optimizer's groups as the engine built them: use_muon and how many parameters each holds."""
    inner = engine.basic_optimizer if getattr(engine, "basic_optimizer", None) is not None else engine.optimizer
    return [{"use_muon": group.get("use_muon"), "params": len(group["params"])} for group in inner.param_groups]


def is_this_error(error: BaseException) -> bool:
    return ((isinstance(error, ValueError) and CAT_ERROR in str(error))
            or (isinstance(error, AttributeError) and RESHAPE_ERROR in str(error)))


def outcome(job: Any, frozen: str) -> str:
    """What ``job`` with ``frozen`` frozen does: ``"ValueError: ..."`` / ``"AttributeError: ..."`` (this bug's
    errors), ``"trains, frozen parameters changed: ..."``, or ``"trains"``; CannotTellError where it fails
    otherwise."""
    try:
        trained = train(job, frozen)
    except (ValueError, AttributeError) as error:
        if is_this_error(error):
            return f"{type(error).__name__}: {error}"
        raise CannotTellError(f"{type(error).__name__}: {str(error)[:200]}") from error
    changed = trained.changed_frozen()
    return f"trains, frozen parameters changed: {', '.join(changed)}" if changed else "trains"


def bug_shows(job: Any, frozen: str) -> bool:
    """True where ``job`` raises this bug's error or changes a frozen parameter; False where it trains and leaves
    them as they were."""
    return outcome(job, frozen) != "trains"


def reproduce() -> bool:
    """ZeRO-1, DeepSpeed's Muon, the MLP's biases frozen (every trainable parameter a matrix, so Muon's): True if
    ``deepspeed.initialize`` raises ``ValueError: torch.cat(): expected a non-empty list of Tensors`` (or a step
    changes a frozen bias); False if it trains, frozen biases unchanged, and on a DeepSpeed without its own Muon
    (the config's "Muon" is then torch.optim.Muon, which has no parameter groups of frozen parameters to build)."""
    if not has_deepspeed_muon():
        return False
    return bug_shows(muon_job(1), "biases")


@dataclass(frozen=True)
class Reference:
    params: dict[str, Any]
    optimizers: tuple[str, ...]


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(update: Any) -> Any:
    """Keller Jordan's orthogonalisation of a 2-D update, as his reference Muon writes it: in bf16, the matrix
    normalised by its Frobenius norm + 1e-7, five quintic Newton-Schulz steps ``X = a X + (b A + c A A) X`` with
    ``A = X X^T``, on the transpose where there are more rows than columns. Plain torch."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def muon_update(grad: Any, momentum_buffer: Any, beta: float, orthogonalise: Callable[[Any], Any]) -> Any:
    """Keller Jordan's ``muon_update``: Nesterov momentum (``buf = lerp(buf, g, 1 - beta)``, ``u = lerp(g, buf,
    beta)``), ``orthogonalise`` (:func:`newton_schulz`), scaled by sqrt(max(1, rows/cols))."""
    momentum_buffer.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum_buffer, beta)
    update = orthogonalise(update)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def compiles_its_muon_update() -> bool:
    """Whether the installed DeepSpeed runs its Muon update under ``torch.compile`` (``@compiler.compile()`` on
    ``muon_update`` and ``zeropower_via_newtonschulz5``). The update is computed in bf16, and a compiled graph
    rounds fewer intermediate results than eager torch, so the plain reference must run the same way to agree
    within the fp32 tolerance."""
    from deepspeed.runtime.zero.muon import original_muon

    return hasattr(original_muon.muon_update, "_torchdynamo_orig_callable")


class PlainMuon:
    """Muon for a list of matrices in plain PyTorch (no DeepSpeed): :func:`muon_update`, decoupled weight decay
    ``p *= 1 - lr * weight_decay``, then ``p -= lr * update``: Keller Jordan's step. ``compiled``: both functions
    under ``torch.compile``, as DeepSpeed compiles its own copies (:func:`compiles_its_muon_update`)."""

    def __init__(self, params: list, lr: float, momentum: float, weight_decay: float, compiled: bool = False) -> None:
        import functools

        import torch

        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.buffers = [torch.zeros_like(p) for p in params]
        orthogonalise = torch.compile(newton_schulz) if compiled else newton_schulz
        update = functools.partial(muon_update, orthogonalise=orthogonalise)
        self.update = torch.compile(update) if compiled else update

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p, buf in zip(self.params, self.buffers):
                update = self.update(p.grad, buf, self.momentum)
                p.mul_(1 - self.lr * self.weight_decay)
                p.add_(update.reshape(p.shape), alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def reference(job: Any, frozen: str) -> Reference:
    """``job`` in plain PyTorch: the same model, frozen parameters and batches; :class:`PlainMuon` for the
    trainable matrices and ``torch.optim.AdamW`` (the config's betas (0.9, 0.95) and eps 1e-10) for
    the other trainable parameters, both with the config's lr and weight_decay. The frozen parameters go to
    neither."""
    import torch

    from ...harness import make_batches, mse

    model = frozen_model(frozen, job.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trainable if p.ndim >= 2]
    others = [p for p in trainable if p.ndim < 2]
    optimizers: list[Any] = []
    if matrices:
        optimizers.append(PlainMuon(matrices, LR, MOMENTUM, WEIGHT_DECAY, compiled=compiles_its_muon_update()))
    if others:
        optimizers.append(torch.optim.AdamW(others, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS,
                                            weight_decay=WEIGHT_DECAY))
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        mse(model(x), y).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    params = {name: p.detach().float().numpy().copy() for name, p in model.named_parameters()}
    return Reference(params, tuple(type(o).__name__ for o in optimizers))


KELLER_JORDAN_SIGNATURE = ["grad", "momentum", "beta", "ns_steps", "nesterov"]


def muon_update_is_keller_jordans() -> bool:
    """Whether the installed DeepSpeed's ``muon_update`` (``deepspeed/runtime/zero/muon/original_muon.py``) is
    Keller Jordan's, which :class:`PlainMuon` writes out: its signature ``(grad, momentum, beta, ns_steps,
    nesterov)``. Releases after the fix rewrote it (a Gram Newton-Schulz in fp16 by default, per-head and expert
    variants); their bf16/fp16 iterations round otherwise, so their Muon half is not compared with the plain
    reference (the frozen parameters still are, and the Adam half where no matrix trains: :func:`verify`)."""
    import inspect

    from deepspeed.runtime.zero.muon import original_muon

    return list(inspect.signature(original_muon.muon_update).parameters) == KELLER_JORDAN_SIGNATURE


def verify(job: Any, frozen: str) -> Any:
    """Train ``job`` with ``frozen`` frozen (the fix applied or not needed), check that every frozen parameter is
    exactly as it was, and compare the weights with :func:`reference` under the fp32 tolerance
    (``harness.assert_close``, which raises where they differ): every parameter where DeepSpeed's Muon update is
    Keller Jordan's (:func:`muon_update_is_keller_jordans`). Elsewhere the frozen parameters, and the Adam-stepped
    ones where no matrix trains: where one does, the Adam half's gradients follow the Muon half's weights, which
    that release computes otherwise. Returns the comparison."""
    from ...harness import assert_close

    trained = train(job, frozen)
    changed = trained.changed_frozen()
    if not trained.frozen or changed:
        raise AssertionError(f"frozen parameters changed: {changed}" if changed else "no parameter is frozen")
    plain = reference(job, frozen).params
    muon_trains = any(value.ndim >= 2 and name not in trained.frozen for name, value in plain.items())
    compared = [name for name, value in plain.items() if muon_update_is_keller_jordans() or name in trained.frozen
                or (value.ndim < 2 and not muon_trains)]
    what = ("weights" if len(compared) == len(plain) else
            "frozen and Adam-stepped weights" if len(compared) > len(trained.frozen) else "frozen weights")
    return assert_close({name: trained.after[name] for name in compared}, {name: plain[name] for name in compared},
                        "float32", f"ZeRO-{job.zero_stage}, {FROZEN_LABELS[frozen]} frozen: {what} vs plain PyTorch")


def refused_under_zero3(job: Any, frozen: str) -> bool:
    """ZeRO-3 with DeepSpeed's Muon: ``deepspeed.initialize`` refuses the optimizer before it builds a group
    (``AssertionError: Muon optimizer is not yet compatible with ZeRO Stage 3``), so the bug cannot show: False.
    CannotTellError where it does anything else."""
    try:
        train(job, frozen)
    except AssertionError as error:
        if "not yet compatible with ZeRO Stage 3" in str(error):
            return False
        raise CannotTellError(f"AssertionError: {str(error)[:200]}") from error
    raise CannotTellError("ZeRO-3 trained with DeepSpeed's Muon: the grid expected it refused")


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): DeepSpeed's Muon with the MLP's biases frozen under
    ZeRO-1 (``initialize`` raises), the same under ZeRO-2, ZeRO-2 with the weights frozen, and ZeRO-0 with the
    first layer frozen (the step raises on a frozen matrix, whose grad is None): every condition holds in each.
    Then each condition flipped on its own: the same model with nothing frozen (ZeRO-1 and ZeRO-0), and ZeRO-3,
    where DeepSpeed refuses Muon before it builds a group.

    Not in the grid, because the trigger cannot read it from a config (its note): under ZeRO-1/2 the bug needs one
    half of Muon's split (matrices; the rest) to have no trainable parameter. With a trainable parameter in both
    halves (the first layer frozen, the second trained) ZeRO-1/2 drop the frozen ones from their own groups and the
    job trains."""
    from ...harness import Cell, trigger_job

    def cell(label: str, stage: int, frozen: str, flips: str = "") -> Cell:
        job = muon_job(stage)
        uses = ("muon-frozen-params",) if frozen != "nothing" else ()
        run = (lambda: refused_under_zero3(job, frozen)) if stage == 3 else (lambda: bug_shows(job, frozen))
        return Cell(label, trigger_job(job, uses=uses), run, flips)

    return [cell("ZeRO-1, Muon, the biases frozen", 1, "biases"),
            cell("ZeRO-2, Muon, the biases frozen", 2, "biases"),
            cell("ZeRO-2, Muon, the weights frozen", 2, "weights"),
            cell("ZeRO-0, Muon, the first layer frozen", 0, "fc1"),
            cell("ZeRO-1, Muon, nothing frozen", 1, "nothing", "uses:muon-frozen-params"),
            cell("ZeRO-0, Muon, nothing frozen", 0, "nothing", "uses:muon-frozen-params"),
            cell("ZeRO-3 instead", 3, "biases", "zero_stage")]

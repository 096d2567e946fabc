"""A DeepSpeed config's three batch sizes, resolved as DeepSpeed resolves them, or rejected as DeepSpeed rejects them.

DeepSpeed reads ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` from the
config, fills in the missing ones from the given ones and the data-parallel size, then asserts that each is positive
and that ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × data-parallel size``
(``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion`` in ``deepspeed/runtime/config.py``, the
same rule in every release from 0.14 to 0.19). :func:`resolve` does the same arithmetic, with the same integer
divisions, and where DeepSpeed's assertion would fail it says so with DeepSpeed's own message: a value that cannot
exist is never passed on to judge a job by.

Two things DeepSpeed does not see, and :func:`resolve` leaves open instead of guessing:

* ``"auto"`` values, which a Hugging Face Trainer (or accelerate) fills in before DeepSpeed reads the config;
* the data-parallel size, where the caller does not know it: the values it decides stay open, and a combination that
  no data-parallel size can satisfy is rejected all the same.

Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
KEYS = (TRAIN, MICRO, GAS)
AUTO = "auto"
RULE = f"{TRAIN} = {MICRO} × {GAS} × data-parallel size"
# DeepSpeed's own assertion when neither of the two is given (its _set_batch_related_parameters)
NEITHER = "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"


@dataclass(frozen=True)
class BatchSizes:
    """The three values as DeepSpeed would run with them. None: not known here (``open`` says which and why);
    ``error``: DeepSpeed rejects the combination (the message names the rule), and then no value is given."""

    train: int | None
    micro: int | None
    gas: int | None
    open: tuple[str, ...] = ()  # the keys left open: "auto" values, or what the data-parallel size decides
    auto: tuple[str, ...] = ()  # of those, the ones the config sets to "auto"
    error: str = ""

    @property
    def rejected(self) -> bool:
        return bool(self.error)

    @property
    def incomplete(self) -> bool:
        """Neither ``train_batch_size`` nor ``train_micro_batch_size_per_gpu`` is given: DeepSpeed stops there, unless
        what launches it adds them first (accelerate and trainers built on DeepSpeed do)."""
        return NEITHER in self.error


def _value(name: str, raw: Any) -> int | str | None:
    """A config value as DeepSpeed would read it: absent (None), "auto", or a whole number; anything else is an
    error DeepSpeed would meet at its first comparison."""
    if raw is None:
        return None
    if isinstance(raw, str) and raw.strip().lower() == AUTO:
        return AUTO
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw:
        raise ValueError(f"{name} is {raw!r}: DeepSpeed needs a whole number (or \"auto\" for a Hugging Face Trainer "
                         "to fill in)")
    return int(raw)


def _rejected(message: str, world_size: int | None) -> BatchSizes:
    size = f" (data-parallel size {world_size})" if world_size is not None else ""
    return BatchSizes(None, None, None, error=f"DeepSpeed rejects this config{size}: {message}; its rule: {RULE}")


def resolve(train: Any, micro: Any, gas: Any, world_size: int | None) -> BatchSizes:
    """The batch sizes DeepSpeed runs with, from the config's values (None where absent, ``"auto"``, or a number)
    and the data-parallel size (None: not known)."""
    try:
        values = {TRAIN: _value(TRAIN, train), MICRO: _value(MICRO, micro), GAS: _value(GAS, gas)}
    except ValueError as exc:
        return _rejected(str(exc), world_size)
    if world_size is not None and world_size < 1:
        return _rejected(f"a data-parallel size of {world_size}", world_size)
    auto = tuple(key for key in KEYS if values[key] == AUTO)
    if auto:  # the trainer fills them in (consistently when all are "auto"); only explicit values are known
        known = {key: (value if isinstance(value, int) else None) for key, value in values.items()}
        open_ = tuple(key for key in KEYS if known[key] is None)
        return BatchSizes(known[TRAIN], known[MICRO], known[GAS], open_, auto)
    t, m, g = values[TRAIN], values[MICRO], values[GAS]
    if world_size is None:
        return _without_world_size(t, m, g)  # type: ignore[arg-type]
    w = world_size
    # DeepSpeedConfig._set_batch_related_parameters, branch by branch
    if t is not None and m is not None and g is not None:
        pass
    elif t is not None and m is not None:
        g = t // m // w
    elif t is not None and g is not None:
        m = t // w // g
    elif m is not None and g is not None:
        t = m * g * w
    elif t is not None:
        g, m = 1, t // w
    elif m is not None:
        t, g = m * w, 1
    else:
        return _rejected(NEITHER, world_size)
    # DeepSpeedConfig._batch_assertion, in its order and with its messages
    assert t is not None and m is not None and g is not None
    if not t > 0:
        return _rejected(f"Train batch size: {t} has to be greater than 0", world_size)
    if not m > 0:
        return _rejected(f"Micro batch size per gpu: {m} has to be greater than 0", world_size)
    if not g > 0:
        return _rejected(f"Gradient accumulation steps: {g} has to be greater than 0", world_size)
    if t != m * g * w:
        return _rejected("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                         f"gradient_acc_step * world_size {t} != {m} * {g} * {w}", world_size)
    return BatchSizes(t, m, g)


def _without_world_size(t: int | None, m: int | None, g: int | None) -> BatchSizes:
    """What holds for every data-parallel size: the values it does not decide, and a rejection where no size
    satisfies the rule."""
    for name, value in ((TRAIN, t), (MICRO, m), (GAS, g)):
        if value is not None and value <= 0:
            return _rejected(f"{name} {value} has to be greater than 0", None)
    if t is None and m is None:
        return _rejected(NEITHER, None)
    if t is not None and m is not None:
        per_rank = m * (g or 1)
        if t % per_rank:
            return _rejected(f"{t} is not a multiple of {m}{f' × {g}' if g else ''}: no data-parallel size "
                             "satisfies it", None)
        if g is not None:
            return BatchSizes(t, m, g)  # the data-parallel size is t / (m × g)
        return BatchSizes(t, m, None, (GAS,))
    if t is not None:
        if g is not None and t % g:
            return _rejected(f"{t} is not a multiple of {GAS} {g}: no data-parallel size satisfies it", None)
        return BatchSizes(t, None, 1 if g is None else g, (MICRO,))
    return BatchSizes(None, m, 1 if g is None else g, (TRAIN,))


def from_config(config: Mapping[str, Any], world_size: int | None) -> BatchSizes:
    """:func:`resolve` over a DeepSpeed config's top-level keys."""
    return resolve(config.get(TRAIN), config.get(MICRO), config.get(GAS), world_size)

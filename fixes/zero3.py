"""ZeRO-3 helpers that fixes, the harness and users share: gather a ZeRO-3 model's parameters safely,
and call it functionally (``torch.func``) with ZeRO-3's module hooks out of the way.

Documented by entry zero3-hooks-torch-func (the workaround for gradients with respect to the
parameters) and used by the harness to read a ZeRO-3 model's parameters (one at a time: entry
zero3-gathered-params-cpu-race). Imports torch and DeepSpeed only when called.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Mapping


@contextlib.contextmanager
def gathered_parameters(module: Any) -> Iterator[dict[str, Any]]:
    """Inside ``deepspeed.zero.GatheredParameters`` over each of ``module``'s parameters, yield
    ``{name: full parameter, detached}`` to pass to :func:`functional_call` under a torch.func
    transform. Gathering happens here, *outside* the transform. Every rank holds the whole model
    for the duration of the block; the tensors are valid only inside it."""
    import deepspeed

    named = dict(module.named_parameters())
    # One parameter per GatheredParameters: with several, DeepSpeed's coalesced gather on the releases
    # entry zero3-gathered-params-cpu-race names waits for the last handle only; on CUDA the stream
    # orders them, on CPU (gloo) the others may still be in flight and the parameters hold
    # uninitialised memory (that entry's notebook measures how often). A single parameter takes the
    # synchronous path. Same order on every rank (named_parameters), so the collectives match.
    with contextlib.ExitStack() as stack:
        for param in named.values():
            stack.enter_context(deepspeed.zero.GatheredParameters([param]))
        yield {name: param.detach() for name, param in named.items()}


@contextlib.contextmanager
def zero3_hooks_suspended(module: Any) -> Iterator[None]:
    """Within the block, ``module`` and its submodules run without ZeRO-3's module hooks (those
    whose function lives in ``deepspeed.runtime.zero``); afterwards every hook dict holds exactly
    what it held before, in the same order. The caller must have the parameters gathered."""
    saved = []
    for sub in module.modules():
        for attribute in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(sub, attribute)
            zero = [key for key, hook in hooks.items() if _is_zero3_hook(hook)]
            if zero:
                saved.append((hooks, dict(hooks)))
                for key in zero:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            added = {key: hook for key, hook in hooks.items() if key not in before}
            hooks.clear()
            hooks.update(before)
            hooks.update(added)


def _is_zero3_hook(hook: Any, depth: int = 3) -> bool:
    """Whether ``hook`` is, or wraps, a function defined in ``deepspeed.runtime.zero``. Decorators
    are looked through: ``functools.wraps`` ones (``__wrapped__``, e.g. ``torch.compiler.disable``) and
    closures over the decorated function (DeepSpeed's ``instrument_w_nvtx`` keeps no ``__wrapped__``)."""
    if (getattr(hook, "__module__", "") or "").startswith("deepspeed.runtime.zero"):
        return True
    if depth == 0:
        return False
    inner = [getattr(hook, "__wrapped__", None)]
    for cell in getattr(hook, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return any(_is_zero3_hook(fn, depth - 1) for fn in inner if inspect.isfunction(fn) or inspect.ismethod(fn))


def functional_call(module: Any, parameters: Mapping[str, Any], args: Any, kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> Any:
    """``torch.func.functional_call(module, parameters, args, kwargs)`` on a ZeRO-3 module, with
    ZeRO-3's module hooks suspended (they cannot fetch the substituted tensors). Use with
    :func:`gathered_parameters`::

        with gathered_parameters(model) as params:
            grads = torch.func.grad(lambda p: loss_fn(functional_call(model, p, (x,)), y))(params)
    """
    import torch

    with zero3_hooks_suspended(module):
        return torch.func.functional_call(module, dict(parameters), args, kwargs, **options)

"""fp16 on DeepSpeed's CPU accelerator, for reproducing fp16 bugs where there is no GPU.

DeepSpeed's ``CPU_Accelerator.is_fp16_supported()`` is ``False`` on 0.16.x and, from 0.17, asks
``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, which is False on CPUs without AVX512-FP16/AMX-FP16
(the Fixbook's CI machine among them). ``DeepSpeedEngine._do_sanity_check`` then refuses every fp16
config with ``ValueError: Type fp16 is not supported on your device.``, although the code under test
(FP16_Optimizer, FP16_UnfusedOptimizer, ZeRO's fp16 paths) is plain PyTorch that runs in fp16 on a
CPU: only slower, and without oneDNN fp16 kernels.

:func:`allow_fp16_on_cpu` tells the CPU accelerator object that fp16 is supported. It is harness
set-up for reproducing on CPU, never a fix, and on CUDA (or any other accelerator) it does nothing.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

_MARK = "_fixbook_fp16_allowed"
_OVERRIDDEN = ("is_fp16_supported", "supported_dtypes")


def allow_fp16_on_cpu() -> bool:
    """Make DeepSpeed's CPU accelerator report fp16 as supported, in this process only.

    Returns True if this process's accelerator is DeepSpeed's CPU accelerator and now reports fp16
    (idempotent), False if it is another accelerator (CUDA: fp16 is supported there; nothing is
    touched). It sets two *instance* attributes on the accelerator object, ``is_fp16_supported``
    and ``supported_dtypes`` (the latter lists torch.float16 too, as the CUDA accelerator's does:
    ZeRO-0's gradient all-reduce buckets gradients by these dtypes). DeepSpeed's classes are not
    changed. Call it after :func:`fixes.harness.setup` and before ``deepspeed.initialize``;
    :func:`fixes.harness.build_engine` calls it for fp16 jobs, also in ranks started by
    :func:`fixes.harness.launch`.
    """
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if type(accelerator).__name__ != "CPU_Accelerator":
        return False
    if not getattr(accelerator, _MARK, False):
        native = type(accelerator).supported_dtypes.__get__(accelerator)

        def supported_dtypes() -> list[Any]:
            dtypes = list(native())
            return dtypes if torch.float16 in dtypes else [*dtypes, torch.float16]

        accelerator.is_fp16_supported = lambda: True
        accelerator.supported_dtypes = supported_dtypes
        setattr(accelerator, _MARK, True)
    return True


def fp16_allowed_on_cpu() -> bool:
    """Whether :func:`allow_fp16_on_cpu` has changed this process's accelerator."""
    from deepspeed.accelerator import get_accelerator

    return bool(getattr(get_accelerator(), _MARK, False))


def restore_fp16_support() -> None:
    """Undo :func:`allow_fp16_on_cpu`: the accelerator answers from its own class again."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if getattr(accelerator, _MARK, False):
        for name in (*_OVERRIDDEN, _MARK):
            vars(accelerator).pop(name, None)


@contextlib.contextmanager
def fp16_on_cpu() -> Iterator[bool]:
    """:func:`allow_fp16_on_cpu` for the block only (yields its answer); what was allowed before the
    block stays allowed. For checks that share a process with others, e.g. the release sweep."""
    already = fp16_allowed_on_cpu()
    allowed = allow_fp16_on_cpu()
    try:
        yield allowed
    finally:
        if allowed and not already:
            restore_fp16_support()

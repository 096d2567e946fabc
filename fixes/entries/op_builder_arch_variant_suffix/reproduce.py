"""How op-builder-arch-variant-suffix is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Nothing is compiled. The two ways DeepSpeed builds a CUDA op are asked for the ``-gencode`` flags they would hand
nvcc for ``fused_adam`` (DeepSpeed's CUDA ``FusedAdamBuilder``, what ``FusedAdam`` loads), with a given
``TORCH_CUDA_ARCH_LIST``:

* :func:`jit_build`: ``FusedAdamBuilder().load()``, DeepSpeed's own ``load()`` and ``jit_load()``, with PyTorch's
  ``torch.utils.cpp_extension.load`` recorded instead of run: the flags are those PyTorch's ``load`` would give
  nvcc, DeepSpeed's own ``-gencode`` flags in ``extra_cuda_cflags`` and PyTorch's
  ``_get_cuda_arch_flags(extra_cuda_cflags)`` (what its ninja file adds; none where DeepSpeed passed its own), read
  with the ``TORCH_CUDA_ARCH_LIST`` DeepSpeed set at that moment;
* :func:`install_build`: the builder outside JIT mode, as ``DS_BUILD_FUSED_ADAM=1 pip install`` runs it (setup.py's
  ``builder()`` hands ``nvcc_args()`` to ``CUDAExtension``, and PyTorch's ``BuildExtension`` adds no arch flag of
  its own where those carry one).

:func:`torch_flags` is the reference: PyTorch's own flags for the same list. ``TORCH_CUDA_ARCH_LIST`` is put back
as it was after each call (DeepSpeed sets it).
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Iterator

from ...exceptions import CannotTellError

ARCH_LIST = "9.0a"  # Hopper with its arch-specific features (wgmma, setmaxnreg): what the user sets
VERIFY_LISTS = ("9.0a", "8.0 9.0a", "9.0;9.0a", "10.0a;12.0a+PTX")  # spaces or ';', plain and variant, +PTX given
INT_ERROR = "invalid literal for int() with base 10"
_GENCODE = re.compile(r"^-gencode=arch=compute_(\w+),code=(sm|compute)_(\w+)$")


@dataclass(frozen=True)
class Build:
    """What one way of building ``fused_adam`` did with an arch list: the ``-gencode`` flags nvcc would get, or the
    error raised before anything was compiled."""

    path: str  # "jit" or "install"
    arch_list: str
    flags: tuple[str, ...] | None = None
    error: str | None = None  # "ValueError: ..."
    no_devices: bool = False  # the JIT path probed the CUDA devices instead of reading the list, and found none

    @property
    def crashed_on_variant(self) -> bool:
        return self.error is not None and INT_ERROR in self.error

    @property
    def sass(self) -> set[str]:
        """The machine-code targets: ``sm_90a`` from ``code=sm_90a``."""
        return targets(self.flags or (), "sm")

    @property
    def ptx(self) -> set[str]:
        """The PTX targets: ``compute_90a`` from ``code=compute_90a``."""
        return targets(self.flags or (), "compute")

    def __str__(self) -> str:
        if self.flags is not None:
            return f"{self.path}: {list(self.flags)}"
        return f"{self.path}: {self.error}"


def targets(flags: tuple[str, ...] | list[str], kind: str) -> set[str]:
    found = set()
    for flag in flags:
        match = _GENCODE.match(flag)
        if match is None:
            raise CannotTellError(f"not a -gencode flag: {flag!r}")
        if match.group(2) == kind:
            found.add(f"{kind}_{match.group(3)}")
    return found


@contextlib.contextmanager
def arch_list(value: str | None) -> Iterator[None]:
    """``TORCH_CUDA_ARCH_LIST`` set to ``value`` (unset for None) inside, and put back as it was after."""
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        if value is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = value
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def builder():
    """DeepSpeed's CUDA builder of ``fused_adam`` (``deepspeed.ops.op_builder.fused_adam``: what the CUDA
    accelerator creates; the CPU accelerator has a CPU builder of its own)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    return FusedAdamBuilder()


class Recorded(Exception):
    """Raised by the recording stand-in for PyTorch's ``load``: the build stops there, nothing is compiled or
    cached as loaded."""


@contextlib.contextmanager
def recording_torch_load() -> Iterator[dict]:
    """``torch.utils.cpp_extension.load`` replaced, while inside, by a recorder: it keeps the ``-gencode`` flags
    PyTorch's ``load`` would give nvcc and the ``TORCH_CUDA_ARCH_LIST`` it would read, then raises
    :class:`Recorded`. A build with no CUDA source (PyTorch's rule when ``with_cuda`` is None) has no nvcc
    flags."""
    import torch.utils.cpp_extension as cpp_extension

    seen: dict = {}

    def load(*args, **kwargs):
        cflags = list(kwargs.get("extra_cuda_cflags") or [])
        with_cuda = kwargs.get("with_cuda")
        if with_cuda is None:  # PyTorch's own rule: CUDA where a source is CUDA
            with_cuda = any(str(source).endswith((".cu", ".cuh")) for source in kwargs.get("sources") or ())
        seen["arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
        seen["flags"] = ([f for f in cflags if f.startswith("-gencode")] + cpp_extension._get_cuda_arch_flags(cflags)
                         if with_cuda else [])
        raise Recorded()

    saved = cpp_extension.load
    cpp_extension.load = load
    try:
        yield seen
    finally:
        cpp_extension.load = saved


def jit_build(value: str = ARCH_LIST, op=None) -> Build:
    """``FusedAdamBuilder().load()`` (or ``op.load()``) with ``TORCH_CUDA_ARCH_LIST=value``, PyTorch's ``load``
    recorded."""
    import torch
    from deepspeed.ops.op_builder.builder import OpBuilder

    op = builder() if op is None else op
    if op.name in OpBuilder._loaded_ops:
        raise CannotTellError(f"{op.name} is already loaded in this process: load() would not build it")
    with arch_list(value), recording_torch_load() as seen:
        try:
            op.load()
        except Recorded:
            return Build("jit", value, tuple(seen["flags"]))
        except IndexError as exc:
            if torch.cuda.device_count() == 0:  # the JIT path asked the devices, not TORCH_CUDA_ARCH_LIST
                return Build("jit", value, error=f"IndexError: {exc}", no_devices=True)
            return Build("jit", value, error=f"IndexError: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded; the caller decides what it says
            return Build("jit", value, error=f"{type(exc).__name__}: {exc}")
    raise CannotTellError("load() returned without building: PyTorch's load was not called")


def install_build(value: str = ARCH_LIST) -> Build:
    """The ``-gencode`` flags of ``FusedAdamBuilder().nvcc_args()`` outside JIT mode, with
    ``TORCH_CUDA_ARCH_LIST=value``: what ``DS_BUILD_FUSED_ADAM=1 pip install`` compiles with."""
    op = builder()
    op.jit_mode = False
    with arch_list(value):
        try:
            flags = [f for f in op.nvcc_args() if f.startswith("-gencode")]
        except Exception as exc:  # noqa: BLE001 - recorded
            return Build("install", value, error=f"{type(exc).__name__}: {exc}")
    return Build("install", value, tuple(flags))


def torch_flags(value: str = ARCH_LIST) -> tuple[str, ...]:
    """PyTorch's own ``-gencode`` flags for ``TORCH_CUDA_ARCH_LIST=value`` (``_get_cuda_arch_flags()``, what its
    ``load`` and ``BuildExtension`` use when the extension passes none): the plain-PyTorch reference."""
    from torch.utils.cpp_extension import _get_cuda_arch_flags

    with arch_list(value):
        return tuple(_get_cuda_arch_flags())


def expected_targets(path: str, value: str) -> tuple[set[str], set[str]]:
    """The SASS and PTX targets a build of ``path`` ("jit" or "install") must ask nvcc for with
    ``TORCH_CUDA_ARCH_LIST=value``: PyTorch's own (:func:`torch_flags`), and on the JIT path also the PTX of the
    highest architecture where no token carries ``+PTX``, which DeepSpeed adds there by design (its docstring: "JIT
    mode auto-adds +PTX to the highest compute capability when no entry already carries it")."""
    from .. import op_builder_arch_variant_suffix as fix

    flags = torch_flags(value)
    sass, ptx = targets(flags, "sm"), targets(flags, "compute")
    tokens = [token for token in value.replace(" ", ";").split(";") if token]
    if path == "jit" and not any(token.endswith("+PTX") for token in tokens):
        parts = [fix.ARCH.match(token).groups() for token in tokens]  # type: ignore[union-attr]
        major, minor, variant, _ = max(parts, key=lambda p: (int(p[0]), int(p[1]), p[2]))
        ptx.add(f"compute_{major}{minor}{variant}")
    return sass, ptx


def builds(value: str = ARCH_LIST) -> list[Build]:
    return [jit_build(value), install_build(value)]


def shows(found: list[Build]) -> bool:
    """True where a build raised the int() ValueError; False where every build gave flags (or the JIT path probed
    the devices, and this machine has none); CannotTellError on any other error."""
    if any(build.crashed_on_variant for build in found):
        return True
    for build in found:
        if build.error is not None and not build.no_devices:
            raise CannotTellError(f"the {build.path} build failed otherwise: {build.error}")
    return False


def reproduce() -> bool:
    """``FusedAdamBuilder().load()`` and the install path's flags with ``TORCH_CUDA_ARCH_LIST=9.0a``, nothing
    compiled: True if either raises ``ValueError: invalid literal for int() with base 10: '0a'``."""
    return shows(builds(ARCH_LIST))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ``fused_adam``'s JIT build with ``TORCH_CUDA_ARCH_LIST=9.0a``
    by DeepSpeed's CUDA builder (what the CUDA accelerator loads); then by the CPU accelerator's ``FusedAdamBuilder``
    (``deepspeed/ops/op_builder/cpu``), which builds C++ only and reads no CUDA arch list; then the CUDA builder with
    the same architecture without its variant (``9.0``). Nothing is compiled in any (PyTorch's ``load`` is recorded)."""
    from ...harness import Cell, trigger_job

    def cpu_builder():
        from deepspeed.ops.op_builder.cpu.fused_adam import FusedAdamBuilder

        return FusedAdamBuilder()

    variant = ("cuda-arch-variant",)
    return [Cell(f"CUDA op builder: FusedAdamBuilder().load(), TORCH_CUDA_ARCH_LIST={ARCH_LIST}",
                 trigger_job(None, 1, uses=variant, accelerator="cuda"), lambda: shows([jit_build(ARCH_LIST)])),
            Cell("the CPU accelerator's FusedAdamBuilder instead", trigger_job(None, 1, uses=variant, accelerator="cpu"),
                 lambda: shows([jit_build(ARCH_LIST, cpu_builder())]), "accelerator"),
            Cell("TORCH_CUDA_ARCH_LIST=9.0 instead (no variant)", trigger_job(None, 1, accelerator="cuda"),
                 lambda: shows([jit_build("9.0")]), "uses:cuda-arch-variant")]

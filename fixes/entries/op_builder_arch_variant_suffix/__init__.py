"""Fix for op-builder-arch-variant-suffix: wraps ``CUDAOpBuilder.compute_capability_args``
(``deepspeed/ops/op_builder/builder.py``).

The wrapper first reads the arch list the original would read, with the original's precedence: under ``jit_mode``
the list ``jit_load()`` kept (``self._jit_arch_list``), else ``TORCH_CUDA_ARCH_LIST``, else none (the original probes
the devices); otherwise ``TORCH_CUDA_ARCH_LIST``, else the ``cross_compile_archs`` argument, else none (DeepSpeed's
defaults). Where that list names no architecture variant (no token ``X.Y<letter>``, e.g. ``9.0a``), or where one
of its tokens is not of the form ``X.Y[<letter>][+PTX]`` at all (a named arch such as ``Hopper``), the original
runs as it is and its answer, or its error, is returned unchanged. Only a list with a variant, every token of
which parses, is handled by the wrapper itself, the way the affected releases handle a list without one (the newest
affected code, upstream PR #8021's sort and dedupe), with the variant kept as part of the architecture, as PyTorch's
``torch.utils.cpp_extension._get_cuda_arch_flags`` keeps it (upstream PR #8619, open, does the same):

* under ``jit_mode`` the tokens are sorted by (major, minor, variant) and ``+PTX`` goes on the highest one if none
  carries it; then ``self.filter_ccs`` (a builder's own filter, by major) runs as in the original;
* architectures are deduplicated by (major, minor, variant), ``+PTX`` kept where any spelling of one carries it, so
  ``9.0`` and ``9.0a`` stay two architectures, as for PyTorch;
* ``enable_bf16`` is False where a major is 7 or below; ``TORCH_CUDA_ARCH_LIST`` is set to the canonical list
  (``9.0a+PTX``), as the original sets it, and in ``jit_mode`` ``[]`` is returned so that PyTorch makes the
  ``-gencode`` flags from it; otherwise the flags are returned: ``-gencode=arch=compute_90a,code=sm_90a`` and, for
  ``+PTX``, ``-gencode=arch=compute_90a,code=compute_90a``.

On the release whose install path does not sort or dedupe (it has the bug in its JIT path only) a list with a
variant is therefore sorted and deduplicated on the install path too; every list without a variant is the
original's. The warning the original prints when ``TORCH_CUDA_ARCH_LIST`` overrides ``cross_compile_archs`` is
printed the same way.

The probe reads ``compute_capability_args``' source: affected where it calls ``int()`` on the minor part of an arch
token with only ``+PTX`` split off (``int(x.split('+')[0])``), which raises ValueError on ``0a``.
"""
from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.ops.op_builder.builder"
_TARGET = Target(_MODULE, "CUDAOpBuilder.compute_capability_args")
# an arch token as PyTorch's TORCH_CUDA_ARCH_LIST spells it: major.minor, an optional variant letter, optional +PTX
ARCH = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")


class OpBuilderArchVariantSuffix(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        function = inspect.unwrap(_TARGET.raw())
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        minor_ints, other_ints = [], []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" and node.args:
                (minor_ints if _splits_off_ptx_only(node.args[0]) else other_ints).append(ast.unparse(node))
        if minor_ints:
            return Probe(True, f"CUDAOpBuilder.compute_capability_args parses the minor part of each arch with "
                               f"{', '.join(dict.fromkeys(minor_ints))}: ValueError on a variant such as 9.0a's '0a'")
        parsed = f" ({', '.join(dict.fromkeys(other_ints))})" if other_ints else ""
        return Probe(False, f"CUDAOpBuilder.compute_capability_args parses no minor part with int(){parsed}; a "
                            "variant such as 9.0a's '0a' is kept as text")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_variant_aware)]


def _splits_off_ptx_only(node: ast.AST) -> bool:
    """``<x>.split('+')[0]``: the minor part with ``+PTX`` split off and anything else (a variant) left in."""
    return (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 0
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr == "split" and len(node.value.args) == 1
            and isinstance(node.value.args[0], ast.Constant) and node.value.args[0].value == "+")


def requested_archs(builder: Any, cross_compile_archs: str | None = None) -> list[str] | None:
    """The arch tokens ``compute_capability_args`` reads, with its precedence; None where it reads no list (it
    probes the devices, or uses DeepSpeed's defaults)."""
    if builder.jit_mode:
        text = getattr(builder, "_jit_arch_list", None) or os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if not text:
            return None
    else:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST")
        text = env if env is not None else cross_compile_archs
        if text is None:
            return None
    return [token.strip() for token in text.replace(" ", ";").split(";") if token.strip()]


def has_variant(tokens: list[str] | None) -> bool:
    """Whether the list names an architecture variant and every token parses (else the original handles it)."""
    if not tokens:
        return False
    matches = [ARCH.match(token) for token in tokens]
    return all(matches) and any(match.group(3) for match in matches if match)


def _order(token: str) -> tuple[int, int, str]:
    major, minor, variant, _ = ARCH.match(token).groups()  # type: ignore[union-attr]
    return int(major), int(minor), variant


def _variant_aware(original: Any) -> Any:
    @functools.wraps(original)
    def compute_capability_args(self, cross_compile_archs=None):
        tokens = requested_archs(self, cross_compile_archs)
        if not has_variant(tokens):
            return original(self, cross_compile_archs)
        env = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not self.jit_mode and env is not None and cross_compile_archs is not None:
            warning = original.__globals__.get("WARNING", "[WARNING]")
            print(f"{warning} env var TORCH_CUDA_ARCH_LIST={env} overrides cross_compile_archs={cross_compile_archs}")
        ccs = list(tokens)
        if self.jit_mode:
            ccs = sorted(ccs, key=_order)
            if not any("+PTX" in cc for cc in ccs):
                ccs[-1] += "+PTX"
        ccs = self.filter_ccs(ccs)
        if len(ccs) == 0:
            raise RuntimeError(
                f"Unable to load {self.name} op due to no compute capabilities remaining after filtering")
        canonical: dict[tuple[int, int, str], bool] = {}
        for cc in ccs:
            token = ".".join(cc) if isinstance(cc, (list, tuple)) else cc
            key = _order(token)
            canonical[key] = canonical.get(key, False) or token.endswith("+PTX")
        archs = sorted(canonical.items())
        self.enable_bf16 = all(major > 7 for (major, _, _), _ in archs)
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{major}.{minor}{variant}{'+PTX' if ptx else ''}"
                                                      for (major, minor, variant), ptx in archs)
        if self.jit_mode:
            return []  # PyTorch makes the -gencode flags from TORCH_CUDA_ARCH_LIST, as in the original
        args = []
        for (major, minor, variant), ptx in archs:
            num = f"{major}{minor}{variant}"
            args.append(f"-gencode=arch=compute_{num},code=sm_{num}")
            if ptx:
                args.append(f"-gencode=arch=compute_{num},code=compute_{num}")
        return args

    return compute_capability_args


FIX = OpBuilderArchVariantSuffix()

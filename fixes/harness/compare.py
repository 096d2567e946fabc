"""Comparing results against a plain-PyTorch reference with one per-dtype tolerance table."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..exceptions import ToleranceError


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol={self.rtol:g}, atol={self.atol:g}"


# The one place tolerances are stated. These are torch.testing.assert_close's defaults per dtype:
# about the rounding error of one operation in that dtype, so a bug that changes an update
# (a dropped micro-batch, a missing loss scale) lies far outside them.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1.3e-6, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-5),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-5),
}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` → ``torch.bfloat16``; rejects dtypes without a tolerance."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, aliases.get(name, name), None)
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {name!r}; known: {', '.join(str(d) for d in TOLERANCES)}")
    return dtype


@dataclass(frozen=True)
class Comparison:
    name: str
    dtype: torch.dtype
    max_abs_diff: float
    tolerance: Tolerance
    close: bool

    def __str__(self) -> str:
        verdict = "within" if self.close else "OUTSIDE"
        return (f"{self.name}: max abs diff {self.max_abs_diff:.3e} ({verdict} "
                f"{str(self.dtype).removeprefix('torch.')} tolerance {self.tolerance})")


def _as_tensors(value: Any) -> dict[str, torch.Tensor]:
    if isinstance(value, Mapping):
        return {str(key): torch.as_tensor(np.asarray(item) if not isinstance(item, torch.Tensor) else item)
                for key, item in value.items()}
    return {"": torch.as_tensor(value)}


def compare(actual: Any, expected: Any, dtype: str | torch.dtype, name: str = "result") -> Comparison:
    """Compare tensors/arrays, or dicts of them with the same keys, under ``TOLERANCES[dtype]``."""
    dtype = dtype_of(dtype)
    tolerance = TOLERANCES[dtype]
    got, want = _as_tensors(actual), _as_tensors(expected)
    if got.keys() != want.keys():
        raise ValueError(f"{name}: different entries: {sorted(got)} vs {sorted(want)}")
    max_diff, close = 0.0, True
    for key in got:
        a, b = got[key].detach().double().cpu(), want[key].detach().double().cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}[{key}]: shape {tuple(a.shape)} vs {tuple(b.shape)}")
        diff = (a - b).abs()
        largest = float(diff.max()) if diff.numel() else 0.0
        # NaN must show as NaN: Python's max(0.0, nan) would say 0.0
        max_diff = largest if math.isnan(largest) or largest > max_diff else max_diff
        close = close and bool(torch.all(diff <= tolerance.atol + tolerance.rtol * b.abs()))
    return Comparison(name, dtype, max_diff, tolerance, close)


def assert_close(actual: Any, expected: Any, dtype: str | torch.dtype, name: str = "result") -> Comparison:
    """Print the comparison and raise ToleranceError if it is outside the dtype's tolerance."""
    result = compare(actual, expected, dtype, name)
    print(result)
    if not result.close:
        raise ToleranceError(str(result))
    return result


def assert_differs(actual: Any, expected: Any, dtype: str | torch.dtype, name: str = "result") -> Comparison:
    """The reproduction's assertion for silent wrong results: the difference must be *outside*
    the dtype's tolerance, otherwise the bug did not show and the notebook must fail."""
    result = compare(actual, expected, dtype, name)
    print(result)
    if result.close:
        raise ToleranceError(f"bug not reproduced: {result}")
    return result

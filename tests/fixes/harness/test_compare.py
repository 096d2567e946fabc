import math

import numpy as np
import pytest
import torch

from fixes.exceptions import ToleranceError
from fixes.harness import TOLERANCES, assert_close, assert_differs, compare, dtype_of


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_when_difference_is_inside_the_dtype_tolerance_then_close(dtype):
    tol = TOLERANCES[dtype]
    expected = torch.ones(3)
    assert compare(expected + 0.5 * (tol.atol + tol.rtol), expected, dtype).close


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_when_difference_is_twice_the_dtype_tolerance_then_not_close(dtype):
    tol = TOLERANCES[dtype]
    expected = torch.ones(3)
    result = compare(expected + 2 * (tol.atol + tol.rtol), expected, dtype)
    assert not result.close
    assert result.max_abs_diff == pytest.approx(2 * (tol.atol + tol.rtol), rel=1e-2)  # 1 + 2e-5 in fp32 rounds


def test_when_dicts_of_arrays_compared_then_max_abs_diff_covers_every_entry():
    result = compare({"a": np.zeros(2), "b": np.array([0.0, 3.0])}, {"a": np.zeros(2), "b": np.zeros(2)}, "fp32")
    assert result.max_abs_diff == 3.0 and not result.close


def test_when_keys_differ_then_value_error():
    with pytest.raises(ValueError, match="different entries"):
        compare({"a": np.zeros(1)}, {"b": np.zeros(1)}, "float32")


def test_when_outside_tolerance_then_assert_close_raises_and_prints(capsys):
    with pytest.raises(ToleranceError, match="OUTSIDE float32"):
        assert_close(torch.ones(2), torch.zeros(2), "float32", "params")
    assert "params: max abs diff 1.000e+00" in capsys.readouterr().out


def test_when_reproduction_finds_no_difference_then_assert_differs_fails():
    with pytest.raises(ToleranceError, match="bug not reproduced"):
        assert_differs(torch.ones(2), torch.ones(2), "bfloat16")


def test_when_dtype_has_no_tolerance_then_clear_error():
    with pytest.raises(ValueError, match="no tolerance for dtype 'int8'"):
        dtype_of("int8")


def test_when_the_result_holds_nan_then_the_max_abs_diff_is_nan_and_not_close():
    got = {"a": np.array([1.0, 2.0]), "b": np.array([np.nan, 1.0])}
    want = {"a": np.array([1.0, 2.5]), "b": np.array([1.0, 1.0])}
    result = compare(got, want, torch.float32)
    assert math.isnan(result.max_abs_diff) and not result.close, result

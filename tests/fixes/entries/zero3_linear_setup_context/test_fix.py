"""zero3-linear-setup-context on real affected releases (0.18.9; 0.16.6, whose backward has an older
fingerprint) and on the newest (fixed) one."""
from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.9"
OLDER = "0.16.6"  # before 0.17.4: backward computes `dim` only when the weight needs a gradient
FIX_ID = "zero3-linear-setup-context"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    return LinearFunctionForZeroStage3


def _grad_through_deepspeed_linear():
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    W, b, x = torch.randn(4, 8), torch.randn(4), torch.randn(5, 8)
    grad = torch.func.grad(lambda W: zero3_linear_wrap(x, W, b).pow(2).sum())(W)
    expected = 2 * torch._C._nn.linear(x, W, b).t() @ x
    torch.testing.assert_close(grad, expected)


def check_fix_makes_torch_func_correct_and_revert_brings_the_bug_back():
    import fixes

    _class()
    signature = fixes.get(FIX_ID).info.error_signatures[0]
    try:
        _grad_through_deepspeed_linear()
    except RuntimeError as exc:
        assert signature in str(exc)
    else:
        raise AssertionError("the bug did not show on an affected release")
    fixes.apply(FIX_ID)
    _grad_through_deepspeed_linear()
    fixes.revert(FIX_ID)
    try:
        _grad_through_deepspeed_linear()
    except RuntimeError as exc:
        assert signature in str(exc)
    else:
        raise AssertionError("revert did not restore DeepSpeed's original code")


def check_fix_on_older_release_matches_plain_pytorch():
    """0.16.0 - 0.17.3 ship the same forward and a backward with another fingerprint: the fix applies,
    torch.func.grad (input, weight and bias) then matches plain PyTorch, and revert brings the bug back."""
    import fixes
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    cls = _class()
    original = dict(vars(cls))
    fix = fixes.get(FIX_ID)
    assert fix.reproduce() is True
    assert fixes.apply(FIX_ID)[0].action == "applied"
    assert fix.reproduce() is False
    _grad_through_deepspeed_linear()
    W, b, x = torch.randn(4, 8), torch.randn(4), torch.randn(3, 5, 8)
    got = torch.func.grad(lambda x, W, b: zero3_linear_wrap(x, W, b).pow(2).sum(), argnums=(0, 1, 2))(x, W, b)
    expected = torch.func.grad(lambda x, W, b: torch._C._nn.linear(x, W, b).pow(2).sum(), argnums=(0, 1, 2))(x, W, b)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    fixes.revert(FIX_ID)
    assert dict(vars(cls)) == original and all(vars(cls)[k] is v for k, v in original.items())
    assert fix.reproduce() is True


def check_fixed_release_is_a_noop_and_upstream_code_works():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _class())
    assert FIX_ID not in [o.fix_id for o in fixes.apply()]  # nothing on this release needs this fix
    _grad_through_deepspeed_linear()


def test_when_applied_then_torch_func_matches_plain_pytorch_and_revert_restores_the_bug():
    call_in_release(AFFECTED, check_fix_makes_torch_func_correct_and_revert_brings_the_bug_back)


def test_when_applied_on_release_before_0_17_4_then_torch_func_matches_plain_pytorch():
    call_in_release(OLDER, check_fix_on_older_release_matches_plain_pytorch)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop_and_upstream_code_works)

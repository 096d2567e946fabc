"""zero3-linear-setup-context on a real affected release (0.18.9) and on the newest (fixed) one."""
from ci import releases
from tests.helpers import call_in_release

AFFECTED = "0.18.9"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    return LinearFunctionForZeroStage3


def _grad_through_deepspeed_linear():
    import torch
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    W, b, x = torch.randn(4, 8), torch.randn(4), torch.randn(5, 8)
    return torch.func.grad(lambda W: zero3_linear_wrap(x, W, b).pow(2).sum())(W), (W, b, x)


def check_apply_is_idempotent_fixes_torch_func_and_revert_restores_identity():
    import torch

    import fixes

    cls = _class()
    original = dict(vars(cls))
    fix = fixes.get("zero3-linear-setup-context")
    assert fix.probe().affected
    try:
        _grad_through_deepspeed_linear()
    except RuntimeError as exc:
        assert fix.info.error_signatures[0] in str(exc)
    else:
        raise AssertionError("the bug did not show on an affected release")

    assert [o.action for o in fixes.apply(fix.id)] == ["applied"]
    patched = dict(vars(cls))
    assert [o.action for o in fixes.apply(fix.id)] == ["already applied"]
    assert dict(vars(cls)) == patched
    assert not fix.probe().affected
    grad, (W, b, x) = _grad_through_deepspeed_linear()
    expected = 2 * (torch._C._nn.linear(x, W, b)).t() @ x
    torch.testing.assert_close(grad, expected)

    assert [o.action for o in fixes.revert(fix.id)] == ["reverted"]
    assert vars(cls).keys() == original.keys()
    assert all(vars(cls)[name] is value for name, value in original.items())
    assert fix.probe().affected


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    cls = _class()

    def forward(ctx, input, weight, bias=None, param_padding=0):  # a changed signature, as upstream does
        return input

    cls.forward = staticmethod(forward)
    before = dict(vars(cls))
    try:
        fixes.apply("zero3-linear-setup-context")
    except fixes.DriftError as exc:
        assert "LinearFunctionForZeroStage3.forward is not the code" in str(exc)
    else:
        raise AssertionError("a drifted target was patched")
    assert dict(vars(cls)) == before
    assert not fixes.get("zero3-linear-setup-context").applied


def check_fixed_release_is_a_noop_that_says_so():
    import fixes

    cls = _class()
    before = dict(vars(cls))
    [outcome] = fixes.apply("zero3-linear-setup-context")
    assert outcome.action == "not needed" and "defines setup_context" in outcome.message, outcome
    assert dict(vars(cls)) == before
    assert fixes.apply() == []  # nothing on this release needs fixing
    _grad_through_deepspeed_linear()  # and upstream's own code works


def test_when_applied_on_affected_release_then_idempotent_correct_and_revertible():
    call_in_release(AFFECTED, __file__, "check_apply_is_idempotent_fixes_torch_func_and_revert_restores_identity")


def test_when_target_signature_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, __file__, "check_drifted_target_raises_and_patches_nothing")


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, __file__, "check_fixed_release_is_a_noop_that_says_so")

"""zero3-linear-unbound-dim-bias-only on its reproduce release (0.17.2), on the oldest swept release, on the first
release upstream fixed (0.17.4) and on the newest; and with zero3-linear-setup-context, which replaces the same
``backward``, in both orders."""
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.17.2"
FIRST_FIXED = "0.17.4"
FIX_ID = "zero3-linear-unbound-dim-bias-only"
SETUP_CONTEXT = "zero3-linear-setup-context"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    return LinearFunctionForZeroStage3


def _gradients(x_grad: bool, weight_grad: bool, shape=(5, 8)):
    """The gradients of ``LinearFunctionForZeroStage3`` and of PyTorch's own linear, for the inputs that require
    one (the bias always does); raises what DeepSpeed's backward raises."""
    import torch

    cls = _class()
    generator = torch.Generator().manual_seed(0)
    x, W, b = (torch.randn(*s, generator=generator) for s in (shape, (4, 8), (4,)))
    leaves = [x.clone().requires_grad_(x_grad), W.clone().requires_grad_(weight_grad), b.clone().requires_grad_()]
    reference = [t.clone().requires_grad_(t.requires_grad) for t in leaves]
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(cls.apply(*leaves).pow(2).sum(), wanted)
    expected = torch.autograd.grad(torch._C._nn.linear(*reference).pow(2).sum(),
                                   [t for t in reference if t.requires_grad])
    return got, expected


def _assert_every_case_matches_pytorch():
    """Every combination of input and weight gradients, with the bias's, 2-D and 3-D inputs: as PyTorch's."""
    import torch

    for shape in ((5, 8), (2, 5, 8)):
        for x_grad in (False, True):
            for weight_grad in (False, True):
                got, expected = _gradients(x_grad, weight_grad, shape)
                for g, e in zip(got, expected):
                    torch.testing.assert_close(g, e)


def _assert_bias_only_raises():
    try:
        _gradients(x_grad=False, weight_grad=False)
    except UnboundLocalError as exc:
        assert "'dim'" in str(exc), exc
    else:
        raise AssertionError("the bias-only gradient did not raise on an affected release")


def check_every_gradient_matches_pytorch_with_the_fix():
    import fixes

    _class()
    _assert_bias_only_raises()
    fixes.apply(FIX_ID)
    try:
        _assert_every_case_matches_pytorch()
    finally:
        fixes.revert(FIX_ID)
    _assert_bias_only_raises()


def check_the_workaround_memory_efficient_linear_false_trains():
    """Without the fix, ``memory_efficient_linear: false`` keeps ``F.linear`` PyTorch's: the same job trains."""
    from fixes.entries.zero3_linear_unbound_dim_bias_only import reproduce as r

    _class()
    assert r.bug_shows(r.job(memory_efficient_linear=False)) is False


def check_composes_with_setup_context_in_either_order():
    """zero3-linear-setup-context replaces the same ``backward`` with one that computes ``dim`` first."""
    import fixes

    cls = _class()
    original = dict(vars(cls))

    def restored():
        assert vars(cls).keys() == original.keys() and all(vars(cls)[k] is v for k, v in original.items())

    # that fix first: this one finds its bug gone and patches nothing
    assert [o.action for o in fixes.apply(SETUP_CONTEXT, FIX_ID)] == ["applied", "not needed"]
    _assert_every_case_matches_pytorch()
    fixes.revert()
    restored()
    # this one first: that fix's drift check reads DeepSpeed's code under this one and applies over it
    assert [o.action for o in fixes.apply(FIX_ID, SETUP_CONTEXT)] == ["applied", "applied"]
    _assert_every_case_matches_pytorch()
    assert not fixes.get(FIX_ID).probe().affected
    fixes.revert()  # the last applied first: that fix, then this one
    restored()
    _assert_bias_only_raises()
    # every fix this release needs (zero3-hooks-torch-func requires that fix and comes first in id order; this
    # one then finds its bug gone and says so), then every one reverted
    outcomes = {o.fix_id: o.action for o in fixes.apply()}
    assert outcomes.get(SETUP_CONTEXT) in ("applied", "already applied"), outcomes
    assert outcomes.get(FIX_ID) == "not needed", outcomes
    _assert_every_case_matches_pytorch()
    fixes.revert()
    restored()


def check_first_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _class())
    assert FIX_ID not in [o.fix_id for o in fixes.apply()]
    _assert_every_case_matches_pytorch()
    fixes.revert()


def test_when_applied_then_every_gradient_of_the_zero3_linear_matches_pytorch():
    call_in_release(AFFECTED, check_every_gradient_matches_pytorch_with_the_fix)


def test_when_memory_efficient_linear_is_false_then_the_job_trains_without_the_fix():
    call_in_release(AFFECTED, check_the_workaround_memory_efficient_linear_false_trains)


def test_when_applied_with_zero3_linear_setup_context_in_either_order_then_both_compose_and_revert_exactly():
    call_in_release(AFFECTED, check_composes_with_setup_context_in_either_order)


def test_when_release_is_the_first_upstream_fixed_then_apply_is_a_noop():
    call_in_release(FIRST_FIXED, check_first_fixed_release_is_a_noop)

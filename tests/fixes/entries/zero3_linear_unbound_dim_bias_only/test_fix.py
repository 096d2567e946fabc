"""zero3-linear-unbound-dim-bias-only on its reproduce release (0.17.2): every combination of gradients the linear
computes (the notebook trains biases only), alone and with zero3-linear-setup-context in both orders; and the
memory_efficient_linear workaround."""
import pytest
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.17.2"
FIX_ID = "zero3-linear-unbound-dim-bias-only"
SETUP_CONTEXT = "zero3-linear-setup-context"


def _class():
    harness.setup()
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    return LinearFunctionForZeroStage3


def _gradients(shape, x_grad, weight_grad):
    """The gradients of ``LinearFunctionForZeroStage3`` and of PyTorch's own linear for the inputs that require one
    (the bias always does); raises what DeepSpeed's backward raises."""
    generator = torch.Generator().manual_seed(0)
    x, W, b = (torch.randn(*s, generator=generator) for s in (shape, (4, 8), (4,)))
    leaves = [x.clone().requires_grad_(x_grad), W.clone().requires_grad_(weight_grad), b.clone().requires_grad_()]
    reference = [t.clone().requires_grad_(t.requires_grad) for t in leaves]
    got = torch.autograd.grad(_class().apply(*leaves).pow(2).sum(), [t for t in leaves if t.requires_grad])
    return got, torch.autograd.grad(torch._C._nn.linear(*reference).pow(2).sum(),
                                    [t for t in reference if t.requires_grad])


def _assert_every_case_matches_pytorch():
    """Input and weight gradients each wanted or not, with the bias's, on 2-D and 3-D inputs: as PyTorch's own."""
    import itertools

    for case in itertools.product(((5, 8), (2, 5, 8)), (False, True), (False, True)):
        for got, expected in zip(*_gradients(*case), strict=True):
            torch.testing.assert_close(got, expected)


def check_the_workaround_memory_efficient_linear_false_trains():
    """Without the fix, ``memory_efficient_linear: false`` keeps ``F.linear`` PyTorch's: the same job trains."""
    from fixes.entries.zero3_linear_unbound_dim_bias_only import reproduce as r

    _class()
    assert r.bug_shows(r.job(memory_efficient_linear=False)) is False


def check_composes_with_setup_context_in_either_order():
    """This fix alone, then with zero3-linear-setup-context (it replaces the same ``backward`` with one that computes
    ``dim`` first) in either order, then every fix the release needs."""
    cls = _class()
    original = dict(vars(cls))

    def restored():
        assert vars(cls).keys() == original.keys() and all(vars(cls)[k] is v for k, v in original.items())

    fixes.apply(FIX_ID)  # this fix alone
    _assert_every_case_matches_pytorch()
    fixes.revert(FIX_ID)
    restored()
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
    with pytest.raises(UnboundLocalError, match="'dim'"):  # the bias-only gradient: the bug is back
        _gradients((5, 8), False, False)
    # every fix this release needs (zero3-hooks-torch-func requires that fix and comes first in id order; this
    # one then finds its bug gone and says so), then every one reverted
    outcomes = {o.fix_id: o.action for o in fixes.apply()}
    assert outcomes.get(SETUP_CONTEXT) in ("applied", "already applied"), outcomes
    assert outcomes.get(FIX_ID) == "not needed", outcomes
    _assert_every_case_matches_pytorch()
    fixes.revert()
    restored()


def test_when_memory_efficient_linear_is_false_then_the_job_trains_without_the_fix():
    call_in_release(AFFECTED, check_the_workaround_memory_efficient_linear_false_trains)


def test_when_applied_alone_or_with_zero3_linear_setup_context_then_every_gradient_matches_pytorch_and_reverts():
    call_in_release(AFFECTED, check_composes_with_setup_context_in_either_order)

"""zero3-linear-setup-context on 0.16.6, in a child process: a backward with an older fingerprint than the notebook's
release (before 0.17.4 it computes ``dim`` only when the weight needs a gradient)."""
from tests.helpers import call_in_release

OLDER = "0.16.6"
FIX_ID = "zero3-linear-setup-context"


def check_fix_on_older_release_matches_plain_pytorch():
    """torch.func.grad of input, weight and bias through DeepSpeed's linear equals plain PyTorch's with the fix."""
    import torch
    import fixes
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from fixes.harness import setup

    setup()
    assert fixes.apply(FIX_ID)[0].action == "applied"
    W, b, x = torch.randn(4, 8), torch.randn(4), torch.randn(3, 5, 8)
    got = torch.func.grad(lambda x, W, b: zero3_linear_wrap(x, W, b).pow(2).sum(), argnums=(0, 1, 2))(x, W, b)
    expected = torch.func.grad(lambda x, W, b: torch._C._nn.linear(x, W, b).pow(2).sum(), argnums=(0, 1, 2))(x, W, b)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_when_applied_on_release_before_0_17_4_then_torch_func_matches_plain_pytorch():
    call_in_release(OLDER, check_fix_on_older_release_matches_plain_pytorch)

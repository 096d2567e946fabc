"""zero-grad-hook-lifetime on torch >= 2.1, in a child process: DeepSpeed's native branch (the notebook runs the
pre-2.1 branch, simulated and on real PyTorch 2.0), which the fix must leave alone."""
from tests.helpers import assert_same_objects, call_in_release

FIX_ID = "zero-grad-hook-lifetime"
USERS = ("deepspeed.utils.torch", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
         "deepspeed.runtime.bf16_optimizer")  # every module that imports register_grad_hook


def check_native_branch_is_a_noop():
    import importlib

    import fixes
    from fixes.harness import setup

    setup()
    modules = [importlib.import_module(name) for name in USERS]
    before = [dict(vars(m)) for m in modules]
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "register_post_accumulate_grad_hook" in outcome.message, outcome
    for module, attributes in zip(modules, before):
        assert_same_objects(module, attributes)


def test_when_torch_has_post_accumulate_grad_hooks_then_apply_is_a_noop():
    call_in_release("0.19.8", check_native_branch_is_a_noop)

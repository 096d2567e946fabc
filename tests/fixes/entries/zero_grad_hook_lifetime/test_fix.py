"""zero-grad-hook-lifetime: on DeepSpeed's torch < 2.1 branch (selected on this torch) and on the native one."""
import pytest

from tests.helpers import assert_same_objects, call_in_release, snapshot

FIX_ID = "zero-grad-hook-lifetime"
USERS = ("deepspeed.utils.torch", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
         "deepspeed.runtime.bf16_optimizer")


def _modules():
    import importlib

    from fixes.harness import setup

    setup()
    return [importlib.import_module(name) for name in USERS]


def _zero2_backward_fires_hooks():
    from fixes import harness

    engine = harness.build_engine(harness.Job(zero_stage=2))
    calls = []
    original = engine.optimizer.process_gradients
    engine.optimizer.process_gradients = lambda *args: (calls.append(1), original(*args))[1]
    x, y = harness.make_batches(harness.ModelSpec(), 1).micro(0, 0, 0)
    engine.backward(harness.mse(engine(x), y))
    return len(calls)


def check_on_pre_2_1_branch_apply_is_idempotent_fixes_hooks_and_revert_is_exact():
    import fixes
    from fixes.entries.zero_grad_hook_lifetime import simulate_torch_before_2_1

    modules = _modules()
    before = [dict(vars(m)) for m in modules]
    with simulate_torch_before_2_1():
        try:
            _zero2_backward_fires_hooks()
        except IndexError:
            pass
        else:
            raise AssertionError("ZeRO-2 backward did not fail on the pre-2.1 branch")
        assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
        assert [o.action for o in fixes.apply(FIX_ID)] == ["already applied"]
        assert all(m.register_grad_hook is modules[0].register_grad_hook for m in modules)
        assert _zero2_backward_fires_hooks() == 4
        fixes.revert(FIX_ID)
    for module, attributes in zip(modules, before):
        assert_same_objects(module, attributes)


def check_drifted_helper_raises_and_patches_nothing():
    import fixes
    from fixes.entries.zero_grad_hook_lifetime import simulate_torch_before_2_1

    helpers = _modules()[0]

    def register_grad_hook(param, hook, keep=None):  # a new signature, the leak kept
        param_tmp = param.expand_as(param)
        grad_acc = param_tmp.grad_fn.next_functions[0][0]
        return grad_acc.register_hook(hook)

    helpers.register_grad_hook = register_grad_hook
    with simulate_torch_before_2_1():
        before = snapshot(helpers)
        try:
            fixes.apply(FIX_ID)
        except fixes.DriftError as exc:
            assert "register_grad_hook is not the code" in str(exc)
        else:
            raise AssertionError("a drifted helper was patched")
        assert_same_objects(helpers, before)
        assert not fixes.get(FIX_ID).applied


def check_native_branch_is_a_noop():
    import fixes

    modules = _modules()
    before = [dict(vars(m)) for m in modules]
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "register_post_accumulate_grad_hook" in outcome.message, outcome
    for module, attributes in zip(modules, before):
        assert_same_objects(module, attributes)
    assert _zero2_backward_fires_hooks() == 4


@pytest.mark.parametrize("release", ["0.17.6", "0.19.8"])
def test_when_pre_2_1_branch_then_fix_makes_hooks_fire_and_revert_is_exact(release):
    call_in_release(release, check_on_pre_2_1_branch_apply_is_idempotent_fixes_hooks_and_revert_is_exact)


def test_when_helper_signature_drifted_then_drift_error_and_nothing_patched():
    call_in_release("0.17.6", check_drifted_helper_raises_and_patches_nothing)


def test_when_torch_has_post_accumulate_grad_hooks_then_apply_is_a_noop():
    call_in_release("0.19.8", check_native_branch_is_a_noop)
